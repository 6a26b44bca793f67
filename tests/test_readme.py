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
