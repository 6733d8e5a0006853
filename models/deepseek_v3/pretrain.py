"""DeepSeek-V3 pretraining: wires the model into te_npu's generic Trainer.

    python -m models.deepseek_v3.pretrain --config recipes/dsv3_tiny_mxfp8.yaml [key=value ...]

(``scripts/pretrain_dsv3.sh`` runs this under torchrun.) Exit codes and what happens on an
error or a signal: ``te_npu.training.job`` (0 done, 1 error, 2 configuration error, 3 stopped
by a divergence rule, 128 + signal when interrupted).
"""
from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F
from torch import nn

from models.deepseek_v3.balance_step import ExpertLoadBalancer
from models.deepseek_v3.config import DeepseekV3Config, validate_16b
from models.deepseek_v3.flops import flops_per_token
from models.deepseek_v3.hf_mapping import DeepseekV3HFAdapter
from models.deepseek_v3.model import DecoderLayer, DeepseekV3ForCausalLM, TopKRouter, initial_value, low_precision_scope
from models.deepseek_v3.model_section import DeepseekV3ModelSection, MTPSection
from models.deepseek_v3.mtp import mtp_cross_entropy, mtp_loss_name
from te_npu.training.config import TrainConfig, load_config
from te_npu.training.job import run_job
from te_npu.training.metrics.throughput import ModelFlops
from te_npu.training.runtime import StopRequest
from te_npu.training.task_step import LossParts, StepEnd, StepReport
from te_npu.training.trainer import Trainer

__all__ = ["DeepseekV3Task", "model_section_of", "model_config", "main"]


def model_section_of(cfg: TrainConfig) -> DeepseekV3ModelSection:
    """The config's ``model`` section, checked as DeepSeek-V3's (a config loaded without it included)."""
    return cfg.with_model_section(DeepseekV3ModelSection).model


def model_config(cfg: TrainConfig) -> DeepseekV3Config:
    """The ``model`` section -> ``DeepseekV3Config`` (preset or HF config.json, then overrides)."""
    return model_section_of(cfg).model_config()


class DeepseekV3Task:
    """``TrainTask`` for ``DeepseekV3ForCausalLM``, trained as DeepSeek-V3 was: the loss is the
    next-token cross-entropy plus the routers' sequence-wise balance loss, and once per step the
    router biases move by the auxiliary-loss-free rule (``model.load_balance``;
    ``models/deepseek_v3/load_balance.py``). With MTP layers (``num_nextn_predict_layers`` = D)
    the loss adds ``lambda / D * sum(mtp_k)`` (``model.mtp``; ``models/deepseek_v3/mtp.py``).

    The MTP weight's schedule needs the step: the Trainer names each step before its micro-batches
    (``step_begin``), so a resumed run weighs its first step by the resumed step's factor.
    """

    model_section = DeepseekV3ModelSection

    def __init__(self) -> None:
        self._balancer: ExpertLoadBalancer | None = None
        self.mtp = MTPSection()
        self.steps_done = 0

    def build(self, cfg: TrainConfig, dtype: torch.dtype) -> nn.Module:
        self.mtp = model_section_of(cfg).mtp
        balance = model_section_of(cfg).load_balance
        model = DeepseekV3ForCausalLM(model_config(cfg), dtype=dtype)
        model.set_seq_aux_loss_coeff(balance.seq_aux_loss_coeff)
        self._balancer = ExpertLoadBalancer(
            ExpertLoadBalancer.routers_of(model, TopKRouter), bias_update_rate=balance.bias_update_rate,
            bias_update_until_step=balance.bias_update_until_step, idle_expert_warn_steps=balance.idle_expert_warn_steps)
        return model

    def validate(self, model: nn.Module, cfg: TrainConfig) -> None:
        if model_section_of(cfg).validate_16b:
            validate_16b(model)

    def initial_value(self, model: nn.Module, fqn: str, *, seed: int) -> torch.Tensor:
        return initial_value(model, fqn, seed)

    def vocab_size(self, cfg: TrainConfig) -> int:
        return model_config(cfg).vocab_size

    def layer_types(self) -> tuple[type[nn.Module], ...]:
        return (DecoderLayer,)

    def low_precision_scope(self, model: nn.Module) -> list[str]:
        return low_precision_scope(model)

    def flops_per_token(self, cfg: TrainConfig) -> ModelFlops:
        """Model FLOPs per training token at the run's sequence length (``models/deepseek_v3/flops.py``)."""
        return flops_per_token(model_config(cfg), cfg.training.seq_len,
                               recompute=cfg.activation_checkpoint.mode == "full")

    def hf_adapter(self, cfg: TrainConfig) -> DeepseekV3HFAdapter:
        """Hugging Face key mapping and config.json rules (``checkpoint.initial_load_path``, exports)."""
        return DeepseekV3HFAdapter(model_config(cfg))

    def loss(self, model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor) -> LossParts:
        """Cross-entropy (``lm_loss``) plus, in a training forward, the balance loss (an extra),
        plus with MTP layers ``lambda / D * sum(mtp_k)``, each depth's loss an extra (``mtp_1_loss``, ...)."""
        # The data pipeline gives labels already shifted (labels[s] = next token of input_ids[s]),
        # so the loss is a plain token-wise cross-entropy, not the HF shift-by-one loss.
        out = model(input_ids)
        lm_loss = F.cross_entropy(out.logits.float().flatten(0, 1), labels.flatten())
        total, extras = lm_loss, {}
        if out.balance_loss is not None:
            total, extras["balance_loss"] = total + out.balance_loss, out.balance_loss
        if out.mtp_logits:
            mtp = {mtp_loss_name(k): mtp_cross_entropy(logits, labels, k) for k, logits in enumerate(out.mtp_logits, 1)}
            total = total + self.mtp.weight(self.steps_done + 1) / len(mtp) * sum(mtp.values())
            extras.update(mtp)
        return LossParts(total, lm_loss, extras)

    def step_begin(self, model: nn.Module, step: int) -> None:
        """Before optimizer step ``step`` (1-based): the step the MTP weight's schedule reads."""
        self.steps_done = step - 1

    def step_end(self, model: nn.Module, ctx: StepEnd) -> StepReport:
        """Once per optimizer step: sum the routers' counts over ranks, move the biases, report."""
        self.steps_done = ctx.step
        return self._balancer.step_end(ctx)


def main(argv: list[str] | None = None) -> int:
    """Parse, validate, train; returns the exit code (a failed multi-rank job exits the process)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="YAML recipe, e.g. recipes/dsv3_tiny_mxfp8.yaml")
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. training.train_steps=20")
    args = parser.parse_args(argv)

    def body(stop: StopRequest) -> None:
        # every config error surfaces here, before any model: the model section's too
        cfg = load_config(args.config, args.overrides, model_section=DeepseekV3ModelSection)
        trainer = Trainer(DeepseekV3Task(), stop=stop)
        try:
            trainer.setup(cfg)  # also picks the quantization kernel (training.quant_kernel) and logs it
            trainer.train()
        except BaseException:
            trainer.abandon()  # no barrier on the error path: run_job reports and exits
            raise
        trainer.close()

    return run_job(body)


if __name__ == "__main__":
    sys.exit(main())
