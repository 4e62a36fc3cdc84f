"""The Python every PyTorch peer of the scripts runs by default: the one whose torch CI checks
against, the newest on PyPI (scripts/torch_venv.sh makes its venv). `$FLOTILLA_TORCH_PYTHON`
names another; `--python` on each script overrides both."""

import os


def default():
    """$FLOTILLA_TORCH_PYTHON, else the venv of scripts/torch_venv.sh
    ($FLOTILLA_TORCH_VENV, default ~/.cache/flotilla-torch-venv) if it is made, else python3."""
    named = os.environ.get("FLOTILLA_TORCH_PYTHON")
    if named:
        return named
    venv = os.environ.get("FLOTILLA_TORCH_VENV") or os.path.expanduser("~/.cache/flotilla-torch-venv")
    python = os.path.join(venv, "bin", "python")
    return python if os.path.exists(python) else "python3"


HELP = ("a Python with torch for the PyTorch peer (default: $FLOTILLA_TORCH_PYTHON, else the "
        "venv scripts/torch_venv.sh makes, with the newest torch)")


if __name__ == "__main__":
    print(default())
