"""Per-source loss of a data mixture: the step's token-mean loss split by the source of each token.

A mixture's micro-batches carry ``source_ids`` (int ``[B, T]``, aligned with ``labels``; see
:mod:`hyper_parallel.data.mixture`). Over one optimizer step the trainer adds every micro-batch
to a :class:`SourceLossMeter`, then :meth:`SourceLossMeter.reduce` sums the per-source token-loss
sums and labelled-token counts over the ranks that hold different tokens (one all-reduce of a
``[2, S]`` tensor) and divides. So ``loss/<name>`` is the mean cross-entropy over that source's
labelled tokens of the whole step, and the token-weighted mean of the per-source losses is the
step's global loss (up to float rounding). Nothing here knows a model or a source type.

Two ways to add a micro-batch:

- ``token_loss_sum=`` the micro-batch's summed token CE (``ce_loss.detach() * num_tokens`` of the
  trainer's global-mean loss): free (no second CE, no host sync) and exact whenever all labelled
  tokens of the micro-batch share one source, which the mixture guarantees (it mixes whole
  micro-batches);
- ``logits=``: per-token CE recomputed in fp32 chunks (no grad), for micro-batches that mix sources.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

__all__ = ["SourceLossMeter", "source_loss_sums"]


@torch.no_grad()
def source_loss_sums(
    logits: torch.Tensor,
    labels: torch.Tensor,
    source_ids: torch.Tensor,
    num_sources: int,
    *,
    ignore_index: int = -100,
    chunk_tokens: int = 4096,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss_sums, token_counts)``, float64 ``[num_sources]``: summed token CE and labelled tokens per source.

    ``logits`` ``[..., V]`` (any float dtype), ``labels`` and ``source_ids`` of the matching leading
    shape; positions labelled ``ignore_index`` count nowhere. CE runs in fp32, ``chunk_tokens`` rows at
    a time (no fp32 copy of all logits).
    """
    logits_NV = logits.reshape(-1, logits.shape[-1])
    labels_N, ids_N = labels.reshape(-1), source_ids.reshape(-1).to(torch.int64)
    if labels_N.shape != ids_N.shape or logits_NV.shape[0] != labels_N.shape[0]:
        raise ValueError(
            f"logits {tuple(logits.shape)}, labels {tuple(labels.shape)} and source_ids {tuple(source_ids.shape)} "
            "must cover the same positions"
        )
    sums = torch.zeros(num_sources, dtype=torch.float64, device=logits.device)
    counts = torch.zeros(num_sources, dtype=torch.float64, device=logits.device)
    keep = labels_N != ignore_index
    for lo in range(0, labels_N.shape[0], chunk_tokens):
        k = keep[lo : lo + chunk_tokens]
        if not bool(k.any()):
            continue
        x = logits_NV[lo : lo + chunk_tokens][k].float()
        ce = F.cross_entropy(x, labels_N[lo : lo + chunk_tokens][k], reduction="none")
        ids = ids_N[lo : lo + chunk_tokens][k]
        sums.index_add_(0, ids, ce.double())
        counts.index_add_(0, ids, torch.ones_like(ce, dtype=torch.float64))
    return sums, counts


class SourceLossMeter:
    """Accumulates per-source token-loss sums over a step (module docstring).

    ``names`` are the data's ``source_names`` (index ``i`` of ``source_ids`` is ``names[i]``).
    """

    def __init__(self, names: Sequence[str], *, device: torch.device | str = "cpu", ignore_index: int = -100) -> None:
        self.names = tuple(names)
        self.ignore_index = ignore_index
        self._sums = torch.zeros(2, len(self.names), dtype=torch.float64, device=device)

    def add(
        self,
        labels: torch.Tensor,
        source_ids: torch.Tensor,
        *,
        token_loss_sum: torch.Tensor | float | None = None,
        logits: torch.Tensor | None = None,
    ) -> None:
        """Add one micro-batch (this rank's part of it): give ``token_loss_sum`` or ``logits``.

        No host sync (it runs between forward and backward): ``token_loss_sum`` is split over the
        sources in proportion to their labelled tokens, which is exact for a single-source
        micro-batch (every mixture micro-batch) and NOT for one that mixes sources (pass ``logits``).
        """
        n, device = len(self.names), self._sums.device
        ids = source_ids.to(device=device, dtype=torch.int64).reshape(-1)
        labelled = (labels.to(device) != self.ignore_index).reshape(-1).to(torch.float64)
        if ids.shape != labelled.shape:
            raise ValueError(f"source_ids {tuple(source_ids.shape)} must match labels {tuple(labels.shape)}")
        counts = torch.zeros(n, dtype=torch.float64, device=device).index_add_(0, ids, labelled)
        if token_loss_sum is not None:
            value = torch.as_tensor(token_loss_sum, device=device).detach().to(torch.float64)
            self._sums[0] += counts / counts.sum().clamp(min=1.0) * value
            self._sums[1] += counts
            return
        if logits is None:
            raise ValueError("SourceLossMeter.add needs token_loss_sum= or logits=")
        sums, cnt = source_loss_sums(logits, labels, source_ids, n, ignore_index=self.ignore_index)
        self._sums[0] += sums.to(device)
        self._sums[1] += cnt.to(device)

    def reduce(self, sum_over_ranks: Callable[[torch.Tensor], torch.Tensor] | None = None) -> dict[str, float]:
        """``{"loss/<name>": mean CE over the step's labelled tokens of that source}`` (sources with no
        labelled token this step are left out); ``sum_over_ranks`` all-reduces the ``[2, S]`` sums
        (the trainer's sum over data/context-parallel ranks). Resets the meter."""
        total = self._sums if sum_over_ranks is None else sum_over_ranks(self._sums)
        sums, counts = total.double().cpu().tolist()
        self._sums.zero_()
        return {f"loss/{name}": s / c for name, s, c in zip(self.names, sums, counts) if c > 0}
