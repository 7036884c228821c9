"""Optional dashboards for a training run, as nanoGPT's wandb_log and torchtitan's metrics loggers: TensorBoard
(torch.utils.tensorboard; pip install tensorboard) and Weights & Biases in offline mode (pip install wandb; sync
later with `wandb sync`). Both are off by default; the results entry records the same curves either way.

Each run is its own run in both, as nanoGPT's and litgpt's users expect: TensorBoard writes to
<tensorboard_dir>/<run name>, so `tensorboard --logdir <tensorboard_dir>` shows one curve per run (a resumed run
appends to its folder; TensorBoard hides what an earlier process logged from the update a process starts at, so a
run started again under its name shows only its own points), and W&B names the run by its name.
"""
from pathlib import Path

from configurator import ConfigError


def tensorboard_folder(cfg):
    """Where a run's TensorBoard events go: a subfolder of tensorboard_dir named after the run."""
    return Path(cfg.tensorboard_dir) / cfg.name


class Dashboards:
    """The dashboards a config turns on; each gets the same scalars at the same update number."""

    def __init__(self, cfg, run_id, out_dir, start_step=0):
        self.writers = []
        if cfg.tensorboard_dir:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise ConfigError("tensorboard_dir is set but the tensorboard package is not installed; "
                                  "pip install tensorboard, or leave tensorboard_dir empty") from None
            folder = tensorboard_folder(cfg)
            try:
                # purge_step: from here on, TensorBoard hides the folder's older events (a run started again under
                # this name, from update 0; or a killed run's points after the checkpoint a resume starts from,
                # keeping those of the checkpoint's own update, which the resumed process does not log again)
                self.tensorboard = SummaryWriter(log_dir=str(folder), purge_step=start_step + 1 if start_step else 0)
            except OSError as exc:
                raise ConfigError(f"tensorboard_dir {cfg.tensorboard_dir!r}: {folder} cannot be written "
                                  f"({exc.strerror}); give a writable folder") from None
            self.writers.append(self._tensorboard)
        if cfg.wandb_log:
            try:
                import wandb
            except ImportError:
                raise ConfigError("wandb_log=True but the wandb package is not installed; pip install wandb, "
                                  "or set wandb_log=False") from None
            # offline: no account or network needed; the run id makes a resumed run continue the same curves
            self.wandb = wandb.init(project=cfg.wandb_project, name=cfg.name, id=run_id, resume="allow",
                                    mode="offline", dir=str(out_dir), config=dict(cfg))
            self.writers.append(self._wandb)

    def _tensorboard(self, step, scalars):
        for key, value in scalars.items():
            self.tensorboard.add_scalar(key, value, step)

    def _wandb(self, step, scalars):
        self.wandb.log(scalars, step=step)

    def log(self, step, scalars):
        """scalars: {"train/loss": 3.1, ...} at update `step`."""
        for write in self.writers:
            write(step, scalars)

    def close(self):
        if hasattr(self, "tensorboard"):
            self.tensorboard.close()
        if hasattr(self, "wandb"):
            self.wandb.finish()
