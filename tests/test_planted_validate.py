"""One planted error per check of ``ropestep validate``, seen by that check and by no other.

Each test monkeypatches the function a check compares against (where the caller looks it up:
``protocol`` and ``realchecks`` both do ``from . import fast`` and call ``fast.<name>(...)``, and
``evaluate_layer`` calls ``project(...)`` from its own module), runs the real path and asserts
that the planted check fails -- its flag false, its ``FAIL`` line on stderr with its exact name,
the same failure in ``report.json`` -- while every other check of the same report (or of the same
realchecks result) keeps its clean outcome.

* ``ropestep validate`` (:func:`ropestep.cli.main`, in process) on the tiny random Qwen2 of
  ``test_protocol`` (7 query heads on 1 KV head, head_dim 64, hidden 448): one context, 3 queries,
  a 16-token block, the last layer, ``--exact-rows 0`` (the oracle rows run in a spawned side
  process that a monkeypatch cannot reach; they are planted through
  :func:`ropestep.realchecks.exact_rows` below instead).  About 1 s per run.
  Planted: ``projected_write``, ``mean_max_abs``, ``reuse_bound``, ``frozen_crosscheck``,
  ``refresh_identity``, ``fast float32/original``.
* :mod:`ropestep.realchecks` on the same model, block and layer, called as ``validate`` calls it
  (``protocol.real_checks`` / ``protocol.oracle_job``): ``conventions`` (the ``v`` part) and
  ``exact_rows`` (``c_rel``, ``readout_rel``, ``y_rel``), the oracle computed once on two rows
  with few keys.

Isolation is checked against a clean run of the same command: every outcome the verdict reads
(each reconstruction row's ``pass_*`` flags and non-finite scalars, each context's calibration
checks, each fast entry's non-finite contexts, each real-head check's ``ok``) is collected by
:func:`_outcomes`, and the planted run's outcomes must differ from the clean run's exactly at the
planted check.  Plants are sized from the check's own tolerance (``contextcheck.TOLERANCES``,
``tolerances.FLOAT64_REL``, the result's ``readout_tol``/``v_tol``), never from a loosened one.
"""
from __future__ import annotations

import math
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from ropestep import cli, contextcheck, fast, models, protocol  # noqa: E402
from ropestep import corpus as cp  # noqa: E402
from ropestep import realchecks as rc  # noqa: E402
from ropestep import tolerances as tl  # noqa: E402
from ropestep.verdict import loads  # noqa: E402

pytestmark = pytest.mark.model

LAYER = 1  # the tiny model's last layer ("--layers last")
PREFIX, QUERIES, SEED = 16, 3, 1
ARGS = ["--corpus", "default", "--contexts", "1", "--queries", str(QUERIES),
        "--prefix-len", str(PREFIX), "--layers", "last", "--heads", "all", "--seed", str(SEED),
        "--exact-rows", "0", "--no-figures", "--quiet"]
PROG = "ropestep validate"
# how far a tolerance-sized plant is put outside its tolerance (the derived per-entry bound)
OUTSIDE = 100.0
# oracle rows for exact_rows: (head, query) on the causal prefix, few keys (5 and 6) so that the
# 50-digit reference is cheap; two heads and two queries, so the column map is exercised
EXACT_ROWS = [(1, 4), (5, 5)]


# ---------------------------------------------------------------------------------------------
# fixtures and helpers
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from test_protocol import build_tiny_qwen2

    return build_tiny_qwen2(tmp_path_factory.mktemp("planted_validate_tiny"))


def _fail_lines(err: str) -> list[tuple[str, str]]:
    """``(where, check)`` of every ``FAIL`` line ``validate`` printed (a check name may hold a
    space, ``fast float32/original``; it ends at `` = value`` or `` [detail]``)."""
    out = []
    for ln in err.splitlines():
        if not ln.startswith(f"{PROG}: FAIL "):
            continue
        where, rest = ln[len(f"{PROG}: FAIL "):].split(": ", 1)
        out.append((where, rest.split(" = ")[0].split(" [")[0]))
    return out


def _validate(tiny_dir: Path, out: Path, capsys=None) -> tuple[int, dict, list]:
    """``ropestep validate`` in process: exit code, the decoded report.json, the FAIL lines."""
    code = cli.main(["validate", "--model", str(tiny_dir), *ARGS, "--out", str(out)])
    err = capsys.readouterr().err if capsys is not None else ""
    return code, loads((out / "report.json").read_text()), _fail_lines(err)


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def _outcomes(report: dict) -> dict:
    """Every outcome the verdict reads (docs/protocol.md section 12.6), keyed by
    ``(where, check)``: True where it passes."""
    out = {}
    for L, lr in report["layers"].items():
        for row in lr["reconstruction"]["rows"]:
            w = f"layer {L} context {row['context']} head {row['head']}"
            for k, v in row.items():
                if k.startswith("pass_"):
                    out[w, k[len("pass_"):]] = bool(v)
            for k in protocol.ROW_SCALARS:
                if k in row:
                    out[w, k] = _finite(row[k])
        for pc in lr["calibration"]["checks"]["per_context"]:
            w = f"layer {L} context {pc['context']}"
            for h, tw, bv in zip(pc["heads"], pc["tokenwise_rel"], pc["bound_violations"]):
                out[f"{w} head {h}", "tokenwise"] = _finite(tw)
                out[f"{w} head {h}", "reuse_bound"] = bv == 0
            for name in ("frozen_crosscheck", "refresh_identity"):
                out[w, name] = _finite(pc[f"{name}_max_abs"]) and bool(pc[f"{name}_pass"])
        for key, ent in lr["fast"].items():
            assert "error" not in ent, ent
            parts = [(hd["head"], hd["nonfinite_contexts"]) for hd in ent["heads"]]
            parts.append(("combined", ent["combined"]["nonfinite_contexts"]))
            for c in range(report["protocol"]["contexts"]):
                for h, bad in parts:
                    out[f"layer {L} context {c} head {h}", f"fast {key}"] = c not in bad
        for rec in lr["real_heads"]["per_context"]:
            for name in protocol.REAL_CHECKS:
                if rec.get(name) is not None:
                    out[f"layer {L} context {rec['context']}", name] = bool(rec[name]["ok"])
    return out


def _nonfinite(report: dict) -> list[str]:
    """Paths of every non-finite number in the sections the verdict's safety net reads."""
    lr = report["layers"][str(LAYER)]
    return [f"{sec}.{p}" for sec, sub in (("reconstruction", lr["reconstruction"]),
                                          ("fast", lr["fast"]),
                                          ("calibration.checks", lr["calibration"]["checks"]),
                                          ("reuse", lr["reuse"]))
            for p, _ in protocol._nonfinite_paths(sub)]


def _only(clean: dict, code: int, report: dict, lines: list, check: str,
          wheres: list[str]) -> None:
    """The planted run failed ``check`` at exactly ``wheres`` and nothing else: exit 1, the FAIL
    lines and the report's failures name that check there, and every other outcome is the
    clean run's."""
    assert code == 1
    want = [(w, check) for w in wheres]
    assert lines == want, lines
    assert [(f["where"], f["check"]) for f in report["verdict"]["failures"]] == want
    assert report["verdict"]["failed_checks"] == len(wheres)
    before, after = _outcomes(clean), _outcomes(report)
    assert before.keys() == after.keys()
    changed = sorted(k for k in before if before[k] != after[k])
    assert changed == sorted(want), changed
    assert all(before[k] for k in want) and not any(after[k] for k in want)


def _where(context: int = 0, head=None) -> str:
    w = f"layer {LAYER} context {context}"
    return w if head is None else f"{w} head {head}"


@pytest.fixture(scope="module")
def clean(tiny_dir, tmp_path_factory):
    """The unplanted run: every check passes, nothing is non-finite."""
    code, report, _ = _validate(tiny_dir, tmp_path_factory.mktemp("clean") / "report")
    assert code == 0, report["verdict"]
    assert report["verdict"] == {"pass": True, "failed_checks": 0, "failures": []}
    assert all(_outcomes(report).values()) and not _nonfinite(report)
    return report


def _heads(report: dict) -> list[int]:
    return list(report["protocol"]["heads"])


# ---------------------------------------------------------------------------------------------
# 1. projected_write
# ---------------------------------------------------------------------------------------------
def test_projected_write_planted(tiny_dir, clean, tmp_path, capsys, monkeypatch):
    """Plants ``+1e-6`` relative on each head's projected *readout* ``(mu + u^T dM) W_o,h`` of
    both banks (``contextcheck.project`` called by ``evaluate_layer`` itself on the tensors
    ``explicit_readout`` returned): only ``pass_projected_write`` compares them (with ``y W_o,h``).
    The combined identity and native checks project the same readouts through the nested
    ``write`` (left alone), the reuse section projects ``y``, ``mu`` and the predictions, so no
    other check sees the plant.  1e-6 is >= 10x outside ``TOLERANCES["projected_write"]`` at
    the largest entry (asserted from the row's own numbers)."""
    planted = 1e-6
    atol, rtol = contextcheck.TOLERANCES["projected_write"]
    orig_project, orig_readout = contextcheck.project, contextcheck.explicit_readout
    readouts: list = []
    hits = [0]

    def readout(st, x_q):
        r = orig_readout(st, x_q)
        readouts.append(r)
        return r

    def project(y, w_o):
        p = orig_project(y, w_o)
        if (sys._getframe(1).f_code.co_name == "evaluate_layer"
                and any(y is r for r in readouts)):
            hits[0] += 1
            return p * (1 + planted)
        return p

    monkeypatch.setattr(contextcheck, "explicit_readout", readout)
    monkeypatch.setattr(contextcheck, "project", project)
    code, report, lines = _validate(tiny_dir, tmp_path / "pw", capsys)
    assert hits[0] == 2  # the prefix and the full bank's per-head readout projections, once each
    heads = _heads(report)
    _only(clean, code, report, lines, "projected_write", [_where(0, h) for h in heads])
    assert not _nonfinite(report)
    rows = [r for r in report["layers"][str(LAYER)]["reconstruction"]["rows"]
            if r["head"] != "combined"]
    for r in rows:
        assert r["pass_projected_write"] is False
        for bank in ("projected_prefix", "projected_full"):
            got = r[bank]["max_abs"]
            big = got / planted  # the largest |readout W_o,h| entry, to first order
            assert got > 10 * (atol + rtol * big), (r["head"], bank, got)


# ---------------------------------------------------------------------------------------------
# 2. mean_max_abs
# ---------------------------------------------------------------------------------------------
def test_mean_max_abs_planted(tiny_dir, clean, tmp_path, capsys, monkeypatch):
    """Plants NaN as the full bank's mean from the prefix mean (``fast.full_bank_mean``, which
    ``evaluate_layer`` calls as ``fast.full_bank_mean``): it is compared only with the full
    bank's own mean, in ``mean_max_abs``, which has no tolerance and fails as non-finite.  The
    identity, relation and native checks read ``fast.step``'s own ``mu``, not this value."""
    def nan_mean(mu_prefix, v_self, n_prefix):
        return torch.full_like(mu_prefix, math.nan)

    monkeypatch.setattr(fast, "full_bank_mean", nan_mean)
    code, report, lines = _validate(tiny_dir, tmp_path / "mean", capsys)
    heads = _heads(report)
    _only(clean, code, report, lines, "mean_max_abs", [_where(0, h) for h in heads])
    rows = report["layers"][str(LAYER)]["reconstruction"]["rows"]
    assert all(math.isnan(r["mean_max_abs"]) for r in rows if r["head"] != "combined")
    # the only non-finite numbers of the report are the planted ones
    assert set(_nonfinite(report)) == {f"reconstruction.rows[{k}].mean_max_abs"
                                       for k, r in enumerate(rows) if r["head"] != "combined"}
    assert [f["detail"] for f in report["verdict"]["failures"]] == ["non-finite"] * len(heads)


# ---------------------------------------------------------------------------------------------
# 3. reuse_bound
# ---------------------------------------------------------------------------------------------
def test_reuse_bound_planted(tiny_dir, clean, tmp_path, capsys, monkeypatch):
    """Plants a reuse bound ``||u_i|| ||dM_i - dM_0||_op`` (``fast.reuse_bound``, called by
    ``evaluate_layer``) scaled down until every measured frozen error exceeds it twice over.
    Only ``bound_violations`` reads the bound (``frozen_reuse`` is called with
    ``bound=False``), so only ``reuse_bound`` fails.

    Scaling by 0.5 (the inventory's plant) is not seen on this model: the bound is loose, the
    measured ``||e_i|| / bound_i`` is 0.03 to 0.1 over its heads and queries.  So the factor is
    ``0.5 min_i ||e_i|| / bound_i`` (queries ``i >= 1``: the anchor's bound is 0), computed in
    the wrapper from ``fast.frozen_reuse`` on the same step, which puts every query of every
    head at ``||e_i|| >= 2 bound_i``, far outside the check's slack
    ``bound (1 + 1e-9) + 1e-12 max|y|``."""
    orig_bound, orig_reuse = fast.reuse_bound, fast.frozen_reuse
    factors: list = []

    def half_the_error(st, anchor=0):
        b = orig_bound(st, anchor)
        en = torch.linalg.vector_norm(orig_reuse(st, anchor, bound=False).error, dim=-1)
        keep = torch.arange(b.shape[1]) != anchor
        f = 0.5 * float((en[:, keep] / b[:, keep]).min())
        factors.append(f)
        return b * f

    monkeypatch.setattr(fast, "reuse_bound", half_the_error)
    code, report, lines = _validate(tiny_dir, tmp_path / "bound", capsys)
    assert len(factors) == 1 and 0 < factors[0] < 0.5
    heads = list(range(report["model"]["n_heads"]))  # the checks run over all H heads
    _only(clean, code, report, lines, "reuse_bound", [_where(0, h) for h in heads])
    assert not _nonfinite(report)
    pc, = report["layers"][str(LAYER)]["calibration"]["checks"]["per_context"]
    assert pc["bound_violations"] == [QUERIES - 1] * len(heads)  # every non-anchor query


# ---------------------------------------------------------------------------------------------
# 4. frozen_crosscheck and 5. refresh_identity
# ---------------------------------------------------------------------------------------------
def _offset(ref: torch.Tensor) -> torch.Tensor:
    """Per head, ``OUTSIDE`` times the identity tolerance ``atol + rtol max|ref_h|`` that
    ``frozen_crosscheck`` and ``refresh_identity`` apply (``TOLERANCES["identity_head"]``),
    broadcast over queries and components: ``(H, 1, 1)``."""
    atol, rtol = contextcheck.TOLERANCES["identity_head"]
    return OUTSIDE * (atol + rtol * ref.abs().amax((1, 2), keepdim=True))


def _plant_frozen_reuse(monkeypatch, change) -> list:
    """``fast.frozen_reuse`` wrapped: ``change(st, reuse) -> (planted reuse, delta)``; returns
    the list the deltas are appended to, one per call."""
    orig = fast.frozen_reuse
    deltas: list = []

    def planted(st, anchor=0, bound=True):
        ru, d = change(st, orig(st, anchor, bound))
        deltas.append(d)
        return ru

    monkeypatch.setattr(fast, "frozen_reuse", planted)
    return deltas


def _reuse_planted(monkeypatch, change, tiny_dir, clean, out, capsys, check) -> tuple:
    """Validate with ``fast.frozen_reuse`` planted (:func:`_plant_frozen_reuse`): only ``check``
    fails, at context 0, nothing non-finite; returns the per-context calibration checks and the
    largest planted offset."""
    deltas = _plant_frozen_reuse(monkeypatch, change)
    code, report, lines = _validate(tiny_dir, out, capsys)
    assert len(deltas) == 1
    _only(clean, code, report, lines, check, [_where(0)])
    assert not _nonfinite(report)
    pc, = report["layers"][str(LAYER)]["calibration"]["checks"]["per_context"]
    return pc, float(deltas[0].max())


def test_frozen_crosscheck_planted(tiny_dir, clean, tmp_path, capsys, monkeypatch):
    """Plants an offset ``delta`` (per head, ``OUTSIDE`` x the identity tolerance) on
    ``fast.frozen_reuse``'s frozen readout ``mu + u_i^T dM_0``, consistently: ``frozen += delta``,
    ``error -= delta`` (``error = y - frozen``) and ``tokenwise -= delta`` (the tokenwise formula
    of ``error``).  The refresh identity ``frozen + tokenwise = y`` and the tokenwise agreement
    ``tokenwise = error`` still hold, and ``||error||`` moves by ``|delta| ~ 1e-5``, far inside
    the loose reuse bound; only the cross-check against ``evaluate_layer``'s own
    ``mu + q_i T_0`` (``frozen_all[0]``) sees ``delta``."""
    def shifted(st, ru):
        d = _offset(ru.frozen)
        return replace(ru, frozen=ru.frozen + d, error=ru.error - d,
                       tokenwise=ru.tokenwise - d), d

    pc, dmax = _reuse_planted(monkeypatch, shifted, tiny_dir, clean, tmp_path / "frozen",
                              capsys, "frozen_crosscheck")
    got = pc["frozen_crosscheck_max_abs"]
    assert dmax * (1 - 1e-9) <= got <= dmax * (1 + 1e-6)  # the plant, to its own rounding
    assert pc["refresh_identity_pass"] and pc["tokenwise_rel"] == pytest.approx(
        clean["layers"][str(LAYER)]["calibration"]["checks"]["per_context"][0]["tokenwise_rel"],
        abs=1e-12)


def test_refresh_identity_planted(tiny_dir, clean, tmp_path, capsys, monkeypatch):
    """Plants an offset ``delta`` (per head, ``OUTSIDE`` x the identity tolerance of ``y``) on
    ``fast.frozen_reuse``'s tokenwise refresh term only.  ``refresh_identity`` compares
    ``frozen + tokenwise`` with ``y`` and fails; the cross-check reads ``frozen`` (untouched),
    the bound and the calibration read ``error`` (untouched), and the tokenwise agreement
    ``max|tokenwise - error| / max|error|`` only fails when non-finite (it moves by ~1e-5)."""
    def refreshed(st, ru):
        d = _offset(st.y)
        return replace(ru, tokenwise=ru.tokenwise + d), d

    pc, dmax = _reuse_planted(monkeypatch, refreshed, tiny_dir, clean, tmp_path / "refresh",
                              capsys, "refresh_identity")
    assert pc["refresh_identity_max_abs"] >= 0.99 * dmax  # the plant, less the clean 1e-15
    assert pc["frozen_crosscheck_pass"] and pc["frozen_crosscheck_max_abs"] == 0.0


# ---------------------------------------------------------------------------------------------
# 6. fast float32/original
# ---------------------------------------------------------------------------------------------
def test_fast_entry_planted(tiny_dir, clean, tmp_path, capsys, monkeypatch):
    """Plants a NaN in one readout entry (head 2, query 0) of ``fast.step`` when it runs in
    float32 in the original gauge -- only ``evaluate_layer``'s ``fast["float32/original"]``
    entry does (every other ``fast.step`` of the run is float64, the other entries bfloat16 or
    the max-key gauge).  The entry's errors against float64, native and its own softmax output
    become non-finite for head 2 and for the combined write, so ``fast float32/original`` fails
    there and nowhere else; its ``kappa`` (not a readout) stays finite."""
    orig = fast.step
    hits = [0]

    def nan_readout(*a, **k):
        st = orig(*a, **k)
        if k.get("dtype") is torch.float32 and k.get("gauge", "original") == "original":
            hits[0] += 1
            st.readout = st.readout.clone()
            st.readout[2, 0, 0] = math.nan
        return st

    monkeypatch.setattr(fast, "step", nan_readout)
    code, report, lines = _validate(tiny_dir, tmp_path / "fast", capsys)
    assert hits[0] == 1
    _only(clean, code, report, lines, "fast float32/original", [_where(0, 2), _where(0, "combined")])
    assert all(p.startswith("fast.float32/original.") for p in _nonfinite(report))
    ent = report["layers"][str(LAYER)]["fast"]["float32/original"]
    assert [hd["nonfinite_contexts"] for hd in ent["heads"]] == [[0] if hd["head"] == 2 else []
                                                                 for hd in ent["heads"]]
    assert all(_finite(ent["kappa"][k]) for k in ("median", "max"))


# ---------------------------------------------------------------------------------------------
# realchecks on the same model, block and layer (as validate calls them)
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def real(tiny_dir):
    """The layer's head description (float64, as ``protocol.run``'s ``head``), the block's bank
    inputs as ``protocol.real_checks`` hands them to ``conventions``, and the oracle prefix and
    reference of ``EXACT_ROWS`` as ``protocol.oracle_job`` hands them to ``exact_rows``."""
    model, tok = models.load_model(tiny_dir)
    blk = cp.select_blocks(cp.load_corpus("default").articles, cp.tokenizer_fn(tok), 1, PREFIX,
                           SEED)[0]
    cap = protocol.capture_context(model, blk, [LAYER], QUERIES, protocol.special_ids(tok))
    spec, w = models.layer_head(model, LAYER, PREFIX, dtype=torch.float64)
    xp = cap.prefix[LAYER].x.double()
    n = max(i for _, i in EXACT_ROWS) + 1
    x_or, pos_or = torch.as_tensor(xp.numpy()[:n]), np.arange(n)
    ref = rc.exact_reference(spec, w, x_or, pos_or, EXACT_ROWS)
    return {"model": model, "spec": spec, "w": w, "xp": xp, "pos": np.arange(xp.shape[0]),
            "x_or": x_or, "pos_or": pos_or, "ref": ref}


# ---------------------------------------------------------------------------------------------
# 7. conventions, the v part
# ---------------------------------------------------------------------------------------------
def test_conventions_v_planted(real):
    """Plants ``W_v (1 + 1e-3)`` in the head description handed to ``conventions`` (``head=``,
    as ``protocol.real_checks`` passes it).  Both ropestep routes (``spec`` and
    ``fast.project``) read ``w_v`` only for the values, so only ``v_rel`` (against the model's
    own ``v_proj``) leaves its tolerance -- on every head, by more than 10x ``v_tol`` (the
    float32 model's bound ``rotated_projection_abs`` over ``m + 1 = 449`` terms is ~4e-5
    relative here, so 1e-3 is ~25x outside it) -- while ``q``, ``k`` and the score scale keep
    their clean values, within their tolerances."""
    spec, w = real["spec"], real["w"]
    args = (real["model"], LAYER, real["xp"], real["pos"])
    ok = rc.conventions(*args, head=(spec, w))
    assert ok["ok"] and all(h["ok"] for h in ok["heads"]) and ok["scale"]["ok"]
    bad = rc.conventions(*args, head=(spec, replace(w, w_v=w.w_v * (1 + 1e-3))))
    assert bad["check"] == "conventions" and bad["ok"] is False
    assert not any(rt["ok"] for rt in bad["routes"].values())  # both routes read w_v
    for h0, h in zip(ok["heads"], bad["heads"]):
        assert h["ok"] is False
        assert h["v_rel"] > 10 * h["v_tol"], h
        for nm in ("q", "k"):  # untouched: the clean numbers, within their tolerance
            assert h[f"{nm}_rel"] == h0[f"{nm}_rel"] and h[f"{nm}_rel"] <= h[f"{nm}_tol"], h
    assert bad["q_rel_max"] == ok["q_rel_max"] and bad["k_rel_max"] == ok["k_rel_max"]
    assert bad["scale"] == ok["scale"] and bad["scale"]["ok"]
    # and the verdict names conventions, its v value, for this context only
    fl = protocol.verdict({"model": {"dtype": "float32"}, "layers": {str(LAYER): {
        "reconstruction": {"rows": []}, "calibration": {"checks": {}}, "fast": {}, "reuse": {},
        "real_heads": {"per_context": [{"context": 0, "conventions": bad}]}}}})
    assert [(f.where, f.check) for f in fl] == [(_where(0), "conventions")]


# ---------------------------------------------------------------------------------------------
# 8.-10. exact_rows: c_rel, readout_rel, y_rel
# ---------------------------------------------------------------------------------------------
FIELDS = ("y_rel", "delta_m_rel", "c_rel", "readout_rel")


def _exact(real: dict) -> dict:
    """``exact_rows`` as ``protocol.oracle_job`` calls it, on the precomputed reference."""
    return rc.exact_rows(real["spec"], real["w"], real["x_or"], real["pos_or"], EXACT_ROWS,
                         reference=real["ref"])


def _tol(row: dict, field: str, res: dict) -> float:
    return row["readout_tol"] if field == "readout_rel" else res["tolerance"]


def _plant_step(monkeypatch, real: dict, what: str, planted: float) -> list:
    """Wrap ``fast.step`` (``exact_rows`` calls ``fast.step``) to move one output by
    ``planted``: ``c`` relatively, ``readout`` or ``y`` by ``planted * S`` with ``S`` each
    oracle row's value scale (the unit ``y_rel`` and ``readout_rel`` are stated in)."""
    orig, ref = fast.step, real["ref"]
    qidx = sorted({i for _, i in EXACT_ROWS})
    hits: list = []

    def moved(*a, **k):
        st = orig(*a, **k)
        hits.append(1)
        if what == "c":
            st.c = st.c * (1 + planted)
            return st
        t = getattr(st, what).clone()
        for h, i in EXACT_ROWS:
            t[h, qidx.index(i)] += planted * ref.value_scale[h, i]
        setattr(st, what, t)
        return st

    monkeypatch.setattr(fast, "step", moved)
    return hits


@pytest.fixture(scope="module")
def exact_clean(real):
    res = _exact(real)
    assert res["ok"] and res["check"] == "exact_rows" and len(res["rows"]) == len(EXACT_ROWS)
    for r in res["rows"]:
        for f in FIELDS:
            assert r[f] <= _tol(r, f, res), (r, f)
    return res


def _exact_only(clean: dict, bad: dict, field: str, planted: float) -> None:
    """Every row fails ``field`` by the planted amount (far outside its tolerance, read from the
    result); the other three fields keep their clean values, within theirs."""
    assert bad["ok"] is False
    assert bad["tolerance"] == clean["tolerance"] == tl.FLOAT64_REL
    for r0, r in zip(clean["rows"], bad["rows"]):
        assert (r["head"], r["query"]) == (r0["head"], r0["query"])
        assert r["ok"] is False
        assert r[field] > tl.DETECT_FACTOR * _tol(r, field, bad), (field, r)
        # the planted amount, to the clean row's own error (triangle inequality) and rounding
        assert abs(r[field] - planted) <= r0[field] + 1e-3 * planted, (field, r)
        for f in FIELDS:
            if f != field:
                assert r[f] == r0[f] and r[f] <= _tol(r, f, bad), (f, r)
    assert bad[f"{field}_max"] == max(r[field] for r in bad["rows"])
    for f in FIELDS:
        if f != field:
            assert bad[f"{f}_max"] == clean[f"{f}_max"]
    # and the verdict names exact_rows for this context
    fl = protocol.verdict({"model": {"dtype": "float32"}, "layers": {str(LAYER): {
        "reconstruction": {"rows": []}, "calibration": {"checks": {}}, "fast": {}, "reuse": {},
        "real_heads": {"per_context": [{"context": 0, "exact_rows": bad}]}}}})
    assert [(f.where, f.check) for f in fl] == [(_where(0), "exact_rows")]
    assert f"{field}_max={bad[f'{field}_max']}" in fl[0].detail


def test_exact_rows_c_rel_planted(real, exact_clean, monkeypatch):
    """Plants ``c *= 1 + 1e-6`` on ``fast.step``'s coefficients as ``exact_rows`` reads them.
    ``y``, ``Delta M`` and the readout are computed inside ``fast.step`` before it returns, so
    only ``c_rel`` (against the oracle's ``c``) moves: to 1e-6, 1e6 x ``FLOAT64_REL``."""
    hits = _plant_step(monkeypatch, real, "c", 1e-6)
    bad = _exact(real)
    assert len(hits) == 1
    _exact_only(exact_clean, bad, "c_rel", 1e-6)


def test_exact_rows_readout_rel_planted(real, exact_clean, monkeypatch):
    """Plants ``readout += 1e-6 S`` (``S`` each row's value scale) on ``fast.step``'s readout
    ``mu + q T + b``: only ``readout_rel`` compares it (with the oracle's ``y``), and it moves to
    1e-6, far outside the row's ``readout_tol``; ``y``, ``c`` and ``Delta M`` are untouched."""
    hits = _plant_step(monkeypatch, real, "readout", 1e-6)
    bad = _exact(real)
    assert len(hits) == 1
    _exact_only(exact_clean, bad, "readout_rel", 1e-6)


def test_exact_rows_y_rel_planted(real, exact_clean, monkeypatch):
    """Plants ``y += 1e-6 S`` on ``fast.step``'s softmax output: only ``y_rel`` compares it (the
    readout is computed independently of ``y`` inside ``fast.step``), and it moves to 1e-6,
    1e6 x ``FLOAT64_REL``; ``c``, ``Delta M`` and the readout are untouched."""
    hits = _plant_step(monkeypatch, real, "y", 1e-6)
    bad = _exact(real)
    assert len(hits) == 1
    _exact_only(exact_clean, bad, "y_rel", 1e-6)
