"""The per-family utilization model: a partially monotone MLP over work and device features.

latency = roofline / utilization + overhead, with utilization = roofline / (roofline + excess) in (0, 1):

    latency = roofline + excess + overhead,     excess = exp(q(work features, device features))  [ms]

``q`` is non-decreasing in every *work* feature (each of which is itself non-decreasing in every kernel
dimension: log dims, log roofline, waves, working set, intensity) for any value of the *device* features
(constant on a GPU). Non-negative weights on the work inputs and after the first layer, with increasing
activations, make that hold by construction; the bound is monotone too (see ``neusight.tiles.gemm_tiles``), so
adding work never lowers a prediction (DESIGN.md "Laws"), for any weights training ends with.
Utilization still rises with size wherever ``q`` grows slower than log(roofline): small kernels waste most
of their bound, big ones approach a plateau.

Features are clamped to the training range (clamping is monotone); beyond the range of the roofline feature
(the first work feature) the excess scales with the roofline, so utilization stays at its boundary value
instead of drifting to 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn
from torch.nn.functional import softplus

LN2 = math.log(2.0)


@dataclass(frozen=True)
class MLPConfig:
    """Hyper-parameters of one family's model (also the training schedule)."""

    hidden: tuple[int, ...] = (64, 64)      # a few layers, a few thousand weights
    dropout: float = 0.0                    # kept for config compatibility; the monotone net uses none
    lr: float = 2e-3
    weight_decay: float = 1e-4
    epochs: int = 60
    batch_size: int = 1024
    patience: int = 10                      # early-stopping epochs without validation improvement
    # True: leave-one-GPU-out picks the epoch count of the final fit (neusight.predictor.train.fit_mlp_logo).
    # False: every fit runs the whole cosine schedule (``epochs``); the held-out GPUs only score it.
    early_stopping: bool = True
    init_overhead_ms: float = 0.01          # launch overhead before training (the data floor is ~0.01-0.03 ms)
    seed: int = 0
    # Loss weight per training row: (waves of the reference tile, clipped to [1, SIZE_WEIGHT_MAX_WAVES]) ** this.
    # 0 = every row counts the same. The sweeps are mostly small kernels; the kernels that make up a model's
    # time run hundreds of waves, so a positive power leans the fit towards them (neusight.predictor.train).
    size_weight: float = 0.0
    # Fits with seeds seed, seed + 1, ... whose forecasts are averaged (geometric mean of their latencies; each
    # fit trained as a single one is). 1 = one fit. docs/ensemble.md measures what it buys on unseen GPUs.
    ensemble: int = 1
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        from neusight.errors import InputError

        def count(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool) and v >= 1

        if not isinstance(self.ensemble, int) or isinstance(self.ensemble, bool) or self.ensemble < 1:
            raise InputError(f"ensemble={self.ensemble!r}: the number of fits to average must be an integer >= 1")
        if not (isinstance(self.hidden, (tuple, list)) and self.hidden and all(count(h) for h in self.hidden)):
            raise InputError(f"hidden={self.hidden!r}: the hidden layer widths must be one or more integers >= 1, "
                             "e.g. [64, 64]")
        for name in ("epochs", "batch_size"):
            if not count(getattr(self, name)):
                raise InputError(f"{name}={getattr(self, name)!r} must be an integer >= 1")
        if not (isinstance(self.patience, int) and self.patience >= 0):
            raise InputError(f"patience={self.patience!r} must be an integer >= 0")
        for name in ("lr", "init_overhead_ms"):
            if not (isinstance(getattr(self, name), (int, float)) and getattr(self, name) > 0):
                raise InputError(f"{name}={getattr(self, name)!r} must be a number > 0")
        for name in ("weight_decay", "size_weight", "dropout"):
            if not (isinstance(getattr(self, name), (int, float)) and getattr(self, name) >= 0):
                raise InputError(f"{name}={getattr(self, name)!r} must be a number >= 0")


GAIN_LOG2_RANGE = 2.0   # device gains lie in [2^-2, 2^2]
MAX_DEVICE_ROWS = 64    # training device-feature vectors kept for the envelope (more: no envelope)


def _gain(z: torch.Tensor) -> torch.Tensor:
    return torch.exp2(GAIN_LOG2_RANGE * torch.tanh(z))


def _gain_np(z: np.ndarray) -> np.ndarray:
    return np.exp2(GAIN_LOG2_RANGE * np.tanh(z))


def _inv_softplus(y: torch.Tensor) -> torch.Tensor:
    return y + torch.log(-torch.expm1(-y))


class UtilizationMLP(nn.Module):
    """Inputs: ``n_mono`` work features (first; the first of them is log2 roofline ms) then device features.

    Hidden layers: tanh (increasing, both convex and concave, so positive-weight stacks can bend either way);
    a monotone linear skip from the work inputs to the output carries the near-linear part of log excess.
    """

    def __init__(self, in_features: int, hidden: tuple[int, ...] = (64, 64), dropout: float = 0.0,
                 init_overhead_ms: float = 0.01, n_mono: int | None = None) -> None:
        super().__init__()
        n_mono = in_features if n_mono is None else int(n_mono)
        if not 1 <= n_mono <= in_features:
            raise ValueError(f"n_mono={n_mono} must be in 1..{in_features}")
        self.in_features, self.n_mono, self.hidden = in_features, n_mono, tuple(hidden)
        widths = (in_features, *self.hidden)
        # raw parameters; constrained weights are softplus(raw) >= 0
        self.w_mono = nn.Parameter(torch.empty(n_mono, widths[1]))
        self.w_free = nn.Parameter(torch.empty(in_features - n_mono, widths[1]))
        # device-dependent positive gains of the first layer's and the output's monotone parts: how strongly a
        # GPU's efficiency responds to the work. Bounded to [1/4, 4] (4 ** tanh of a linear map of the device
        # features): an unbounded gain let a GPU with a device-feature combination not seen in training (T4
        # held out of the bmm fit) reach exp(huge) excess.
        self.w_gain = nn.Parameter(torch.zeros(in_features - n_mono, widths[1]))
        self.w_out_gain = nn.Parameter(torch.zeros(in_features - n_mono))
        self.b = nn.ParameterList([nn.Parameter(torch.zeros(w)) for w in self.hidden])
        self.w_hidden = nn.ParameterList([nn.Parameter(torch.empty(a, b)) for a, b in zip(self.hidden[:-1], self.hidden[1:])])
        self.w_out = nn.Parameter(torch.empty(self.hidden[-1]))
        self.b_out = nn.Parameter(torch.zeros(1))
        self.w_skip = nn.Parameter(torch.empty(n_mono))
        raw = torch.log(torch.expm1(torch.tensor(float(init_overhead_ms))))
        self.raw_overhead = nn.Parameter(raw.reshape(1))
        self.register_buffer("mean", torch.zeros(in_features))
        self.register_buffer("std", torch.ones(in_features))
        self.register_buffer("lo", torch.full((in_features,), -torch.inf))
        self.register_buffer("hi", torch.full((in_features,), torch.inf))
        # Envelope: at prediction, log excess is kept between the lowest and highest the model gives the same
        # kernel with each training device-feature vector (set by ``fit_device_range``). Each feature inside
        # its training range does not make a combination familiar: T4 held out of the bmm fit (cc 7.5 with a
        # 70 W board) otherwise got a 250x excess. Min, max and clamp of monotone functions are monotone, so
        # the law holds; a training GPU's own prediction is one of the envelope's members, so it is unchanged.
        self.register_buffer("device_rows", torch.zeros(MAX_DEVICE_ROWS, in_features - n_mono))
        self.register_buffer("n_device_rows", torch.zeros((), dtype=torch.long))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Positive weights of about 1/fan-in (so tanh starts in its linear range), free ones Gaussian."""
        with torch.no_grad():
            for w in (self.w_mono, *self.w_hidden):
                w.copy_(_inv_softplus(torch.rand(w.shape) * (2.0 / w.shape[0]) + 1e-3))
            self.w_free.normal_(0.0, 1.0 / max(1, self.w_free.shape[0]) ** 0.5)
            self.w_out.copy_(_inv_softplus(torch.rand(self.w_out.shape) * (2.0 / self.w_out.shape[0]) + 1e-3))
            self.w_skip.copy_(_inv_softplus(torch.full(self.w_skip.shape, 0.05)))

    def init_output(self, roof_std_log2: float, roof_mean_log2: float) -> None:
        """Start at excess = roofline (utilization 1/2 everywhere): skip weight on log2 roofline = its std·ln 2."""
        with torch.no_grad():
            self.w_skip[0] = _inv_softplus(torch.tensor(max(roof_std_log2 * LN2, 1e-3)))
            self.b_out.fill_(roof_mean_log2 * LN2)

    @torch.no_grad()
    def fit_device_range(self, x: torch.Tensor) -> None:
        """Keep the distinct device-feature vectors of training rows ``x`` (raw features) for the envelope;
        none (no envelope) when there are more than MAX_DEVICE_ROWS of them. They are inputs, not weights: the
        training loop sets them once per fit."""
        self.device_rows.zero_()
        if self.in_features <= self.n_mono:   # no device features (torch.unique refuses zero-width rows)
            self.n_device_rows.fill_(0)
            return
        rows = torch.unique(x[:, self.n_mono:], dim=0)
        n = len(rows) if 0 < len(rows) <= MAX_DEVICE_ROWS else 0
        self.device_rows[:n] = rows[:n]
        self.n_device_rows.fill_(n)

    @property
    def overhead_ms(self) -> torch.Tensor:
        return softplus(self.raw_overhead)

    def log_excess(self, x: torch.Tensor) -> torch.Tensor:
        """(n, in_features) raw features -> (n,) natural log of the excess over the roofline, in ms."""
        q = self._log_excess(x)
        n = int(self.n_device_rows)
        if self.training or n == 0:
            return q
        alts = torch.stack([self._log_excess(torch.cat([x[:, :self.n_mono], r.to(x.dtype).expand(len(x), -1)], 1))
                            for r in self.device_rows[:n]])
        return torch.minimum(torch.maximum(q, alts.min(0).values), alts.max(0).values)

    def _log_excess(self, x: torch.Tensor) -> torch.Tensor:
        xc = torch.maximum(torch.minimum(x, self.hi), self.lo)
        z = (xc - self.mean) / self.std
        zm, zf = z[:, :self.n_mono], z[:, self.n_mono:]
        h = torch.tanh((zm @ softplus(self.w_mono)) * _gain(zf @ self.w_gain) + zf @ self.w_free + self.b[0])
        for w, b in zip(self.w_hidden, list(self.b)[1:]):
            h = torch.tanh(h @ softplus(w) + b)
        q = (h @ softplus(self.w_out)) * _gain(zf @ self.w_out_gain) + self.b_out + zm @ softplus(self.w_skip)
        return q + (x[:, 0] - xc[:, 0]) * LN2          # beyond the roofline range: excess ∝ roofline

    def forward(self, x: torch.Tensor, roofline_ms: torch.Tensor) -> torch.Tensor:
        """Predicted latency in ms."""
        return roofline_ms + torch.exp(self.log_excess(x)) + self.overhead_ms

    def numpy_params(self) -> dict[str, object]:
        """The effective (constrained) parameters in float64, for the row-wise numpy forward."""
        with torch.no_grad():
            d = lambda t: t.detach().double().numpy().copy()   # noqa: E731
            return {"lo": d(self.lo), "hi": d(self.hi), "mean": d(self.mean), "std": d(self.std), "n_mono": self.n_mono,
                    "first": (d(softplus(self.w_mono.double())), d(self.w_free), d(self.b[0])),
                    "gain": (d(self.w_gain), d(self.w_out_gain)),
                    "device_rows": d(self.device_rows[:int(self.n_device_rows)]),
                    "hidden": [(d(softplus(w.double())), d(b)) for w, b in zip(self.w_hidden, list(self.b)[1:])],
                    "out": (d(softplus(self.w_out.double())), d(self.b_out)),
                    "skip": d(softplus(self.w_skip.double())),
                    "overhead": float(softplus(self.raw_overhead.double()).item())}


def log_excess_rowwise(p: dict, x: np.ndarray, chunk: int = 2048) -> np.ndarray:
    """``UtilizationMLP.log_excess`` (eval mode, with the envelope) in float64, row by row; see
    ``_log_excess_rowwise``."""
    x = np.asarray(x, dtype=np.float64)
    q = _log_excess_rowwise(p, x, chunk)
    rows = p.get("device_rows")
    if rows is None or len(rows) == 0:
        return q
    n_mono = p["n_mono"]
    alts = np.stack([_log_excess_rowwise(p, np.concatenate([x[:, :n_mono], np.broadcast_to(r, (len(x), len(r)))], 1), chunk)
                     for r in rows])
    return np.minimum(np.maximum(q, alts.min(0)), alts.max(0))


def _log_excess_rowwise(p: dict, x: np.ndarray, chunk: int = 2048) -> np.ndarray:
    """``UtilizationMLP.log_excess`` in float64 with every row computed on its own: each dot product is
    accumulated term by term in a fixed order with elementwise operations, so a row's result depends on
    nothing but that row (a BLAS matrix product blocks rows together, and numpy's reductions pick their
    summation order by array layout, so either can change the last bits with the batch). This is what makes a
    prediction the same bit for bit whatever else is predicted with it, in any order."""
    def dot(h: np.ndarray, w: np.ndarray) -> np.ndarray:
        w = np.atleast_2d(w.T).T                       # (in,) -> (in, 1)
        acc = np.zeros((h.shape[0], w.shape[1]))
        for j in range(h.shape[1]):
            acc += h[:, j:j + 1] * w[j]
        return acc

    n_mono = p["n_mono"]
    w_m, w_f, b0 = p["first"]
    out = np.empty(len(x))
    for s in range(0, len(x), chunk):
        raw = x[s:s + chunk]
        xc = np.minimum(np.maximum(raw, p["lo"]), p["hi"])
        z = (xc - p["mean"]) / p["std"]
        zm, zf = z[:, :n_mono], z[:, n_mono:]
        g1, g_out = p["gain"]
        pre = dot(zm, w_m)
        if zf.shape[1]:
            pre = pre * _gain_np(dot(zf, g1)) + dot(zf, w_f)
        h = np.tanh(pre + b0)
        for w, b in p["hidden"]:
            h = np.tanh(dot(h, w) + b)
        w_o, b_o = p["out"]
        q = dot(h, w_o)[:, 0]
        if zf.shape[1]:
            q = q * _gain_np(dot(zf, g_out)[:, 0])
        q = q + b_o[0] + dot(zm, p["skip"])[:, 0]
        out[s:s + chunk] = q + (raw[:, 0] - xc[:, 0]) * LN2
    return out


class MLPEnsemble(nn.Module):
    """Fits of one family's :class:`UtilizationMLP` that differ only in their seed. A kernel's latency is the
    geometric mean of theirs (neusight.predictor.train.predict_mlp): each member is at least the roofline and
    non-decreasing in the work features, so their geometric mean is too."""

    def __init__(self, members: list[UtilizationMLP]) -> None:
        super().__init__()
        if not members:
            raise ValueError("an ensemble needs at least one fitted model")
        self.members = nn.ModuleList(members)

    @property
    def overhead_ms(self) -> torch.Tensor:
        """The members' mean launch overhead."""
        return torch.stack([m.overhead_ms.reshape(()) for m in self.members]).mean().reshape(1)


def build_model(n_features: int, cfg: MLPConfig, n_mono: int | None) -> nn.Module:
    """An untrained model of ``cfg``'s shape, to load saved weights into: one UtilizationMLP, or an
    MLPEnsemble of ``cfg.ensemble`` of them."""
    def make() -> UtilizationMLP:
        return UtilizationMLP(n_features, tuple(cfg.hidden), cfg.dropout, cfg.init_overhead_ms, n_mono=n_mono)

    return make() if cfg.ensemble == 1 else MLPEnsemble([make() for _ in range(cfg.ensemble)])
