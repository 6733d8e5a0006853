"""A run chooses its quantization kernel once, from ``training.quant_kernel``: validated with the
config, logged once by rank 0, and used for every quantization and decode of the run."""
from __future__ import annotations

import typing
from collections import Counter
from pathlib import Path

import pytest

from models.deepseek_v3.pretrain import DeepseekV3Task
from te_npu.errors import ConfigError
from te_npu.ops.kernels import KERNELS, QUANT_KERNEL_CHOICES, QUANT_KERNEL_METHODS
from te_npu.training.config import TrainingConfig, load_config
from te_npu.training.trainer import Trainer

REPO = Path(__file__).resolve().parents[2]


def _config(tmp_path: Path, *extra: str, recipe: str = "mxfp8"):
    return load_config(REPO / "recipes" / f"dsv3_tiny_{recipe}.yaml", [
        "model.overrides={num_hidden_layers: 2, n_shared_experts: 2}",
        "fsdp_config.dp_shard_size=1", "training.seq_len=32", "training.micro_batch_size=2",
        "training.train_steps=1", "training.eval_steps=1", f"data.cache_dir={tmp_path / 'data'}",
        f"data.max_bytes={2**18}", f"logging.dir={tmp_path / 'logs'}", "logging.plot=false",
        f"checkpoint.dir={tmp_path / 'ckpt'}", "checkpoint.interval=0", "checkpoint.resume=false", *extra,
    ])


def _count_kernel_calls(monkeypatch) -> Counter:
    """Spy on every computing method of every variant instance in the table."""
    calls: Counter = Counter()
    for name, kernels in KERNELS.items():
        for method in QUANT_KERNEL_METHODS:
            original = getattr(kernels, method)
            monkeypatch.setattr(kernels, method,
                                lambda *a, _f=original, _k=(name, method), **kw: calls.update([_k]) or _f(*a, **kw))
    return calls


@pytest.mark.parametrize("recipe", ["mxfp8", "hif8"])
def test_auto_on_cpu_runs_native_for_every_quantization_and_decode_and_logs_it_once(tmp_path, monkeypatch, recipe):
    calls = _count_kernel_calls(monkeypatch)
    lines: list[str] = []
    trainer = Trainer(DeepseekV3Task(), print_fn=lines.append)
    trainer.setup(_config(tmp_path, recipe=recipe))  # training.quant_kernel defaults to auto
    try:
        trainer.train_step()
        trainer.evaluate()
    finally:
        trainer.close()
    logged = [line for line in lines if "quantization kernel" in line]
    assert logged == [" quantization kernel: native (auto: CPU run, the native C++ kernels built here)"], lines
    by_variant = Counter({variant: n for (variant, _), n in calls.items()})
    assert set(by_variant) == {"native"}, calls  # nothing quantized or decoded outside the run's choice
    methods = {method for (_, method) in calls}
    expected = ({"mxfp8_quantize_dual", "mxfp8_quantize", "mxfp8_quantize_grouped", "mxfp8_decode",
                 "mxfp8_decode_grouped"} if recipe == "mxfp8" else {"hif8_quantize", "hif8_decode"})
    assert expected <= methods, calls


def test_named_kernel_is_used_and_a_bf16_run_builds_nothing(tmp_path, monkeypatch):
    calls = _count_kernel_calls(monkeypatch)
    lines: list[str] = []
    trainer = Trainer(DeepseekV3Task(), print_fn=lines.append)
    trainer.setup(_config(tmp_path, "training.quant_kernel=eager"))
    try:
        trainer.train_step()
    finally:
        trainer.close()
    assert [line for line in lines if "quantization kernel" in line] == [" quantization kernel: eager (as configured)"]
    assert {variant for (variant, _) in calls} == {"eager"}
    bf16_lines: list[str] = []
    bf16 = Trainer(DeepseekV3Task(), print_fn=bf16_lines.append)
    bf16.setup(_config(tmp_path / "bf16", recipe="bf16"))
    bf16.close()
    assert " quantization kernel: eager (auto: no low-precision recipe, nothing is quantized)" in bf16_lines


def test_config_offers_exactly_the_kernel_table_and_auto():
    assert typing.get_args(typing.get_type_hints(TrainingConfig)["quant_kernel"]) == QUANT_KERNEL_CHOICES


@pytest.mark.parametrize(("override", "message"), [
    ("training.quant_kernel=fast", r"training\.quant_kernel: 'fast' is not supported; allowed values are "
                                   r"\['auto', 'eager', 'compiled', 'native'\]"),
    ("training.quant_kernel=native", r"training\.quant_kernel: 'native' kernels run on cpu tensors only, not on "
                                     r"'cuda' \(training\.device is 'cuda'\)"),
])
def test_config_rejects_a_kernel_it_cannot_run_naming_the_key(tmp_path, override, message):
    with pytest.raises(ConfigError, match=message):
        _config(tmp_path, "training.device=cuda", "training.backend=auto", override)
