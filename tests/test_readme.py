"""The README's Python example runs verbatim and shows what it claims."""
import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_example_runs(capsys):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "README has no python example"
    ns: dict = {}
    exec(compile(blocks[0], "README.md", "exec"), ns)
    err = float(capsys.readouterr().out.strip().splitlines()[-1])
    # y_i = mu_i + u_i^T dM_i in float64: a whole-layer agreement check (tolerances.py)
    import torch

    from ropestep import tolerances

    x, st = ns["x"], ns["st"]
    tol = tolerances.agreement_rel_tol(torch.float64, x.shape[0], ns["spec"].head_dim, x.shape[1])
    assert err <= tol * float(st.y.abs().max()), (err, tol)


def test_readme_library_example_runs(capsys, monkeypatch):
    """The README's library example (attach or load, run, one head's Delta M_i, its readout
    against the model within the bound, the reuse plot) runs verbatim on SmolLM2 and prints
    what its comments say."""
    import pytest

    pytest.importorskip("transformers")
    from ropestep import models

    try:
        models.locate_smollm2_gguf()
    except models.ModelLoadError as err:
        pytest.skip(str(err))
    import matplotlib

    matplotlib.use("Agg")
    blocks = [b for b in re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
              if "ropestep.load(" in b]
    assert len(blocks) == 1
    assert len([ln for ln in blocks[0].splitlines() if ln.strip()]) <= 12
    ns: dict = {}
    exec(compile(blocks[0], "README.md", "exec"), ns)
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-2] == "(577, 64)"
    err, bound = (float(t) for t in out[-1].split(" <= "))
    st = ns["st"]
    assert st.passed and err <= bound and st.space == "input"
    import matplotlib.pyplot as plt

    plt.close("all")
