"""The repository's modules are imported by their bare names (`python train.py` puts its folder first on the
path), so a module or package here that shares its name with an installed distribution's hides that package from
every library that imports it. transformers 5.25 imports Hugging Face's `kernels` package, and our kernels folder,
then named kernels/, broke every test that loads a transformers Llama."""
import importlib.metadata
import importlib.util
import pathlib
import sys

import env


def repository_import_names():
    """The names `import NAME` finds in the repository's root: its modules and its folders of Python code."""
    root = env.REPO
    modules = {p.stem for p in root.glob("*.py")}
    packages = {p.name for p in root.iterdir() if p.is_dir() and any(p.glob("*.py"))}
    return modules | packages


def test_no_module_here_hides_an_installed_package():
    installed = importlib.metadata.packages_distributions()  # import name -> the distributions that provide it
    hidden = {name: installed[name] for name in repository_import_names() if name in installed}
    assert hidden == {}, f"modules here hide installed packages of the same name: {hidden}"


def test_transformers_finds_its_own_kernels_package():
    """What broke: transformers' Llama imports `kernels` when the distribution is installed."""
    assert "model_kernels" in repository_import_names() and "kernels" not in repository_import_names()
    spec = importlib.util.find_spec("kernels")
    if spec is not None:  # installed with transformers 5.25 and later
        assert pathlib.Path(spec.origin).parent.parent != env.REPO, spec.origin
    from transformers import LlamaForCausalLM  # noqa: F401  (imports hub_kernels, which imports `kernels`)
    assert "transformers.models.llama.modeling_llama" in sys.modules
