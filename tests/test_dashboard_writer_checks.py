"""dashboard.py: the W&B run's identity and settings, and TensorBoard's events on disk once the dashboards close."""
import dashboard
import settings
import train


def test_the_wandb_run_is_named_for_the_run_resumable_by_its_id_and_holds_the_config(tmp_path, fake_wandb):
    cfg = settings.Config(train.DEFAULTS, name="my-run", wandb_log=True, wandb_project="my-project",
                          tensorboard_dir="")
    boards = dashboard.Dashboards(cfg, "run-id-1", tmp_path / "out")
    boards.log(5, {"train/loss": 3.0})
    boards.close()
    (kind, kwargs), *rest = fake_wandb
    assert kind == "init" and kwargs == {"project": "my-project", "name": "my-run", "id": "run-id-1",
                                         "resume": "allow", "mode": "offline", "dir": str(tmp_path / "out"),
                                         "config": dict(cfg)}
    assert rest == [("log", 5, {"train/loss": 3.0}), ("finish",)]


def test_tensorboard_events_are_on_disk_once_the_dashboards_close(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    cfg = settings.Config(train.DEFAULTS, name="tb-run", wandb_log=False, tensorboard_dir=str(tmp_path / "tb"))
    boards = dashboard.Dashboards(cfg, "run-id-2", tmp_path / "out")
    for step in (1, 2):
        boards.log(step, {"train/loss": 4.0 - step})
    boards.close()
    events = EventAccumulator(str(tmp_path / "tb" / "tb-run"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(1, 3.0), (2, 2.0)]
