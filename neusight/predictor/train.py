"""Fitting the per-family utilization MLPs on a decomposed trace frame (fit/predict contract)."""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from neusight.predictor.mlp import MLPConfig, MLPEnsemble, UtilizationMLP, log_excess_rowwise

log = logging.getLogger(__name__)


@dataclass
class FitResult:
    model: UtilizationMLP | MLPEnsemble
    history: list[dict] = field(default_factory=list)
    best_epoch: int = 0
    val_groups: tuple[str, ...] = ()
    member_epochs: tuple[int, ...] = ()     # an ensemble's: each member's best epoch


SIZE_WEIGHT_MAX_WAVES = 1024.0


def _loss(pred: torch.Tensor, y: torch.Tensor, w: torch.Tensor | None = None) -> torch.Tensor:
    """Relative error as a symmetric log ratio (|log pred - log y|, smoothed near 0); weighted mean with ``w``."""
    if w is None:
        return torch.nn.functional.smooth_l1_loss(torch.log(pred), torch.log(y), beta=0.05)
    err = torch.nn.functional.smooth_l1_loss(torch.log(pred), torch.log(y), beta=0.05, reduction="none")
    return (err * w).sum() / w.sum()


def mape(pred: np.ndarray, y: np.ndarray, weights: np.ndarray | None = None) -> float:
    """Mean absolute % error; with ``weights``, their weighted mean."""
    return float(np.average(np.abs(pred - y) / y, weights=weights) * 100)


def size_weights(log2_waves: np.ndarray, power: float) -> np.ndarray | None:
    """Per-row loss weights ``waves ** power`` (waves clipped to [1, SIZE_WEIGHT_MAX_WAVES]), or None for
    power 0 (every row the same). Waves of the reference tile grow with the work on any GPU, so the weight says
    "how big is this kernel for its device" the same way on every GPU."""
    if not power:
        return None
    if power < 0:
        raise ValueError(f"size_weight={power}: the loss-weight power must be >= 0 (0 = unweighted)")
    waves = np.clip(np.exp2(np.asarray(log2_waves, dtype=float)), 1.0, SIZE_WEIGHT_MAX_WAVES)
    return waves ** float(power)


def fit_mlp(x: np.ndarray, roofline_ms: np.ndarray, y_ms: np.ndarray, groups: np.ndarray, cfg: MLPConfig,
            val_groups: tuple[str, ...] = (), progress: bool = False, desc: str = "", refit_all: bool = True,
            n_mono: int | None = None, weights: np.ndarray | None = None) -> FitResult:
    """Fit one family's MLP (the first ``n_mono`` columns of ``x`` are work features, the first of them
    log2 roofline). Rows of ``val_groups`` (whole GPUs) are held out for early stopping; with ``refit_all``
    the model is then refitted on all rows for the chosen number of epochs. Without ``cfg.early_stopping``
    every epoch runs and the refit runs the whole schedule; with ``refit_all=False`` the state kept is still
    the epoch that scored best on the held-out rows (callers wanting a blind fit pass no ``val_groups``, as
    :func:`fit_mlp_logo` does). ``weights`` (per row, e.g. :func:`size_weights`) weight both the training loss
    and the early-stopping MAPE."""
    torch.manual_seed(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)
    val = np.isin(groups, list(val_groups))
    tr = ~val
    if not tr.any():
        raise ValueError("no training rows left after holding out the validation GPUs")
    X = torch.as_tensor(x, dtype=torch.float32)
    R = torch.as_tensor(np.asarray(roofline_ms, dtype=np.float32))
    Y = torch.as_tensor(np.asarray(y_ms, dtype=np.float32))
    W = None if weights is None else torch.as_tensor(np.asarray(weights, dtype=np.float32))
    if W is not None and (W.shape != Y.shape or not bool(torch.isfinite(W).all()) or bool((W <= 0).any())):
        raise ValueError(f"weights: expected {len(Y)} finite positive values, got shape {tuple(W.shape)}")
    model = UtilizationMLP(x.shape[1], cfg.hidden, cfg.dropout, cfg.init_overhead_ms, n_mono=n_mono)
    model.mean.copy_(X[tr].mean(0))
    model.std.copy_(X[tr].std(0).clamp_min(1e-3))
    model.lo.copy_(X[tr].min(0).values)
    model.hi.copy_(X[tr].max(0).values)
    model.init_output(float(model.std[0]), float(model.mean[0]))
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=cfg.epochs)
    idx_tr = torch.as_tensor(np.flatnonzero(tr))
    idx_val = torch.as_tensor(np.flatnonzero(val))
    model.fit_device_range(X[idx_tr])   # the envelope's device vectors: inputs, fixed for the whole fit
    best, best_state, best_epoch, bad = float("inf"), None, 0, 0
    patience = cfg.patience if cfg.early_stopping else cfg.epochs + 1   # without early stopping: every epoch
    history: list[dict] = []
    epochs = range(cfg.epochs)
    if progress:
        from tqdm import tqdm

        epochs = tqdm(epochs, desc=desc or "fit", leave=False)
    for epoch in epochs:
        model.train()
        perm = idx_tr[torch.randperm(len(idx_tr), generator=gen)]
        total = 0.0
        for i in range(0, len(perm), cfg.batch_size):
            b = perm[i:i + cfg.batch_size]
            opt.zero_grad(set_to_none=True)
            loss = _loss(model(X[b], R[b]), Y[b], None if W is None else W[b])
            loss.backward()
            opt.step()
            total += float(loss.detach()) * len(b)
        sched.step()
        model.eval()
        with torch.no_grad():
            check = idx_val if len(idx_val) else idx_tr
            pred = model(X[check], R[check]).numpy()
            score = mape(pred, Y[check].numpy(), None if W is None else W[check].numpy())
        history.append({"epoch": epoch, "train_loss": total / len(perm), "val_mape": score})
        if progress:
            epochs.set_postfix(loss=f"{total / len(perm):.4f}", val_mape=f"{score:.1f}")
        if score < best - 1e-4:
            best, best_state, best_epoch, bad = score, copy.deepcopy(model.state_dict()), epoch, 0
        else:
            bad += 1
            if bad >= patience:
                break
    if best_state is not None:
        model.load_state_dict(best_state)
    model.eval()
    if refit_all and len(idx_val):
        # Early stopping chose the epoch count on held-out GPUs; refit on every GPU for that many epochs,
        # so the validation GPUs' measurements are not lost to the final model.
        # (without early stopping the held-out GPUs only scored the fit; the refit runs the whole schedule)
        epochs = best_epoch + 1 if cfg.early_stopping else cfg.epochs
        full = fit_mlp(x, roofline_ms, y_ms, groups, replace(cfg, epochs=epochs, patience=cfg.epochs + 1), (),
                       progress=progress, desc=desc, refit_all=False, n_mono=n_mono, weights=weights)
        return FitResult(full.model, history + full.history, best_epoch, tuple(val_groups))
    return FitResult(model, history, best_epoch, tuple(val_groups))


def predict_mlp(model: UtilizationMLP, x: np.ndarray, roofline_ms: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(latency_ms, utilization) for rows of features.

    NB: one thread: these are tiny matrices (tens to thousands of rows) where thread start-up costs more
    than the work, badly so when other processes share the cores.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _predict_mlp(model, x, roofline_ms)
    finally:
        torch.set_num_threads(threads)


def _predict_mlp(model: UtilizationMLP | MLPEnsemble, x: np.ndarray,
                 roofline_ms: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    roof = np.asarray(roofline_ms, dtype=np.float64)
    if isinstance(model, MLPEnsemble):   # geometric mean of the members' latencies
        lat = [_predict_mlp(m, x, roof)[0] for m in model.members]
        out = np.exp(np.mean(np.log(lat), axis=0))
        overhead = float(model.overhead_ms.detach())
        return out, roof / np.maximum(out - overhead, roof)
    p = model.numpy_params()
    excess = np.exp(log_excess_rowwise(p, np.asarray(x, dtype=np.float64)))
    return roof + excess + p["overhead"], roof / (roof + excess)


def fit_ensemble_logo(x: np.ndarray, roofline_ms: np.ndarray, y_ms: np.ndarray, groups: np.ndarray, cfg: MLPConfig,
                      progress: bool = False, desc: str = "", n_mono: int | None = None,
                      weights: np.ndarray | None = None) -> tuple[FitResult, dict[str, float]]:
    """:func:`fit_mlp_logo` once per seed of ``cfg.ensemble`` (cfg.seed, cfg.seed + 1, ...). With one, exactly
    fit_mlp_logo; else the result's model is their :class:`MLPEnsemble`, its best epoch the first member's and
    its leave-one-GPU-out MAPE per GPU the members' mean (each member's own fold score)."""
    if cfg.ensemble == 1:
        return fit_mlp_logo(x, roofline_ms, y_ms, groups, cfg, progress, desc, n_mono, weights)
    fits, scores = [], []
    for i in range(cfg.ensemble):
        res, logo = fit_mlp_logo(x, roofline_ms, y_ms, groups, replace(cfg, seed=cfg.seed + i, ensemble=1), progress,
                                 f"{desc} #{i}" if desc else "", n_mono, weights)
        fits.append(res)
        scores.append(logo)
    logo = {g: round(float(np.mean([s[g] for s in scores])), 2) for g in scores[0]}
    first = fits[0]
    return FitResult(MLPEnsemble([f.model for f in fits]), first.history, first.best_epoch, first.val_groups,
                     tuple(f.best_epoch for f in fits)), logo


def fit_mlp_logo(x: np.ndarray, roofline_ms: np.ndarray, y_ms: np.ndarray, groups: np.ndarray, cfg: MLPConfig,
                 progress: bool = False, desc: str = "", n_mono: int | None = None,
                 weights: np.ndarray | None = None) -> tuple[FitResult, dict[str, float]]:
    """Leave-one-GPU-out over the training GPUs, then a fit on every GPU.

    For each GPU (scikit-learn's ``LeaveOneGroupOut``), train on the others. With ``cfg.early_stopping``, the
    held-out MAPE is recorded after every epoch and the epoch count that minimises the mean of these curves
    is used to refit on all rows. Without it, each fold trains exactly as the final fit does (the whole
    schedule, no look at the held-out GPU) and is scored on its held-out GPU at the end. Returns the final fit
    and each GPU's held-out MAPE (an honest unseen-GPU score in the second case; in the first the epoch was
    chosen on these curves).
    """
    from sklearn.model_selection import LeaveOneGroupOut

    uniq = np.unique(groups)
    if len(uniq) < 2:
        res = fit_mlp(x, roofline_ms, y_ms, groups, cfg, (), progress=progress, desc=desc, n_mono=n_mono,
                      weights=weights)
        return res, {}
    if not cfg.early_stopping:
        return _fit_full_schedule(x, roofline_ms, y_ms, groups, cfg, progress, desc, n_mono, weights)
    curves: dict[str, list[float]] = {}
    for _, held in LeaveOneGroupOut().split(x, y_ms, groups):
        g = str(groups[held[0]])
        res = fit_mlp(x, roofline_ms, y_ms, groups, cfg, (g,), progress=progress, desc=f"{desc} [-{g}]",
                      refit_all=False, n_mono=n_mono, weights=weights)
        c = [h["val_mape"] for h in res.history]
        curves[g] = c + [c[-1]] * (cfg.epochs - len(c))
    mean = np.mean(np.array(list(curves.values())), axis=0)
    best = int(np.argmin(mean))
    final = fit_mlp(x, roofline_ms, y_ms, groups, replace(cfg, epochs=best + 1, patience=cfg.epochs + 1), (),
                    progress=progress, desc=desc, n_mono=n_mono, weights=weights)
    final.best_epoch = best
    final.val_groups = tuple(curves)
    return final, {g: round(float(c[best]), 2) for g, c in curves.items()}


def _fit_full_schedule(x: np.ndarray, roofline_ms: np.ndarray, y_ms: np.ndarray, groups: np.ndarray, cfg: MLPConfig,
                       progress: bool, desc: str, n_mono: int | None,
                       weights: np.ndarray | None) -> tuple[FitResult, dict[str, float]]:
    """fit_mlp_logo without early stopping: folds trained like the final fit, scored once on their GPU."""
    from sklearn.model_selection import LeaveOneGroupOut

    scores: dict[str, float] = {}
    for keep, held in LeaveOneGroupOut().split(x, y_ms, groups):
        g = str(groups[held[0]])
        res = fit_mlp(x[keep], roofline_ms[keep], y_ms[keep], groups[keep], cfg, (), progress=progress,
                      desc=f"{desc} [-{g}]", refit_all=False, n_mono=n_mono,
                      weights=None if weights is None else weights[keep])
        pred, _ = predict_mlp(res.model, x[held], roofline_ms[held])
        scores[g] = round(mape(pred, y_ms[held], None if weights is None else weights[held]), 2)
    final = fit_mlp(x, roofline_ms, y_ms, groups, cfg, (), progress=progress, desc=desc, n_mono=n_mono,
                    weights=weights)
    final.val_groups = tuple(scores)
    return final, scores
