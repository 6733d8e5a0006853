"""The once-per-step side of DeepSeek-V3's expert balancing in training (the Trainer's
``step_end`` seam, ``te_npu.training.task_step``): the step's expert counts and balance losses
summed over every data-parallel rank in one all-reduce, the router biases moved by the rule of
``models.deepseek_v3.load_balance``, the routing figures reported and long-idle experts named.

Legend: L MoE layers (routers), E routed experts.
"""
from __future__ import annotations

import re
from collections.abc import Sequence

import torch
from torch import nn

from models.deepseek_v3.load_balance import routing_figures, updated_expert_bias
from te_npu.training.task_step import StepEnd, StepReport

__all__ = ["ExpertLoadBalancer"]


class ExpertLoadBalancer:
    """The once-per-step side of the balancing over every router of a model (the MTP layers'
    included): sums the step's expert counts and balance losses over ranks (one all-reduce),
    moves the biases, reports the routing figures and names experts idle for many steps.

    ``routers``: ``(label, router)`` pairs, label e.g. ``layer_3``; a router (``TopKRouter``) has
    ``e_score_correction_bias [E]``, ``take_step_counts() -> (counts int64 [E], balance loss sum,
    micro-batches)``."""

    def __init__(self, routers: Sequence[tuple[str, nn.Module]], *, bias_update_rate: float,
                 bias_update_until_step: int | None, idle_expert_warn_steps: int) -> None:
        self.routers = list(routers)
        self.rate, self.until, self.warn_after = bias_update_rate, bias_update_until_step, idle_expert_warn_steps
        self._idle_steps: torch.Tensor | None = None  # [L, E] steps in a row without a token (host)

    @staticmethod
    def routers_of(model: nn.Module, router_type: type[nn.Module]) -> list[tuple[str, nn.Module]]:
        """Every ``router_type`` module of ``model`` with its label (``layer_<n>`` from the FQN)."""
        found = []
        for fqn, module in model.named_modules():
            if isinstance(module, router_type):
                layer = re.search(r"layers\.(\d+)\.", fqn + ".")
                found.append((f"layer_{layer.group(1)}" if layer else fqn, module))
        return found

    def rate_at(self, step: int) -> float:
        """The bias update rate of (1-based) ``step``: ``bias_update_rate``, 0 after the until-step."""
        return 0.0 if self.until is not None and step > self.until else self.rate

    @torch.no_grad()
    def step_end(self, ctx: StepEnd) -> StepReport:
        """Sum the step's counts over ranks, move the biases (not on a skipped step), report."""
        if not self.routers:
            return StepReport()
        taken = [router.take_step_counts() for _, router in self.routers]
        counts_LE = torch.stack([counts for counts, _, _ in taken]).to(torch.float64)
        losses_L1 = torch.stack([loss.to(torch.float64) / max(n, 1) for _, loss, n in taken]).reshape(-1, 1)
        summed = ctx.all_reduce_sum(torch.cat([counts_LE, losses_L1], dim=1))  # the step's one collective
        counts_LE, losses_L = summed[:, :-1], summed[:, -1] / ctx.world_size
        rate = self.rate_at(ctx.step)
        if ctx.updated and rate > 0:
            for (_, router), counts_E in zip(self.routers, counts_LE):
                bias = router.e_score_correction_bias
                bias.copy_(updated_expert_bias(bias, counts_E, rate))
        return self._report(counts_LE, losses_L)

    def _report(self, counts_LE: torch.Tensor, losses_L: torch.Tensor) -> StepReport:
        figures = routing_figures(counts_LE)
        biases = torch.stack([router.e_score_correction_bias.detach().float().cpu() for _, router in self.routers])
        bias_min, bias_max = biases.min(dim=-1)[0].tolist(), biases.max(dim=-1)[0].tolist()
        metrics: dict[str, float] = {}
        for (label, _), fig, lo, hi, loss in zip(self.routers, figures, bias_min, bias_max, losses_L.tolist()):
            metrics.update({f"moe/{label}/load_max": fig.load_max, f"moe/{label}/load_min": fig.load_min,
                            f"moe/{label}/load_cv": fig.load_cv,
                            f"moe/{label}/experts_under_10pct": float(fig.experts_under_10pct),
                            f"moe/{label}/bias_min": lo, f"moe/{label}/bias_max": hi,
                            f"moe/{label}/balance_loss": loss})
        worst = max(range(len(figures)), key=lambda i: figures[i].load_cv)
        fig = figures[worst]
        summary = (f"routing (worst {self.routers[worst][0]}): cv {fig.load_cv:.2f} max {fig.load_max:.2f}x "
                   f"min {fig.load_min:.2f}x under 10%: {fig.experts_under_10pct}")
        return StepReport(metrics=metrics, summary=summary, warnings=self._idle_warnings(counts_LE))

    def _idle_warnings(self, counts_LE: torch.Tensor) -> tuple[str, ...]:
        """Name each expert whose run of token-less steps reaches a multiple of ``warn_after``."""
        idle_LE = (counts_LE == 0).cpu()
        if self._idle_steps is None:
            self._idle_steps = torch.zeros(idle_LE.shape, dtype=torch.int64)
        self._idle_steps = torch.where(idle_LE, self._idle_steps + 1, torch.zeros_like(self._idle_steps))
        due = (self._idle_steps > 0) & (self._idle_steps % self.warn_after == 0)
        return tuple(
            f"MoE {self.routers[layer][0]}: expert {expert} got no token for {int(self._idle_steps[layer, expert])} "
            f"steps in a row (its bias is {float(self.routers[layer][1].e_score_correction_bias[expert]):+.4f})"
            for layer, expert in due.nonzero().tolist())
