"""``export: {merge: true}``: merged/ loads with AutoModelForCausalLM and computes what base + adapter compute."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from tests.trainer_util import build_tiny, events, output, run_trainer, summary, write_job
from trainq.watcher.spec.contract import EXIT_OK

#: merged vs adapter+base logits (fp32 on the CPU): the same sums in a different order
LOGIT_TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return build_tiny(tmp_path_factory.mktemp("tiny"))


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


@pytest.mark.parametrize("method", ["lora", "qlora"])
def test_merged_export_matches_adapter_plus_base(tiny, tmp_path, method):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from trainq.trainer.config import load_config
    from trainq.trainer.modeling import disable_avx512bf16_repack, load_base, resolve_precision

    job = write_job(
        tmp_path / "job",
        tiny,
        method=method,
        max_steps=6,
        lr=0.01,
        eval_every=None,
        export={"merge": True},
        lora={"r": 8, "dropout": 0.0},
        checkpoint={"every_steps": 100},
    )
    assert run_trainer(job) == EXIT_OK, output(job)
    assert summary(job)["merged"] == "merged" and events(job, "export")
    check = subprocess.run(["sha256sum", "-c", "SHA256SUMS"], cwd=job, capture_output=True, text=True)
    assert check.returncode == 0 and "merged/model.safetensors: OK" in check.stdout, check.stdout
    assert (job / "merged" / "tokenizer.json").is_file()

    merged = AutoModelForCausalLM.from_pretrained(str(job / "merged"), local_files_only=True)
    base = load_base(load_config(job), resolve_precision("fp32"))
    if method == "qlora":
        assert events(job, "export")[0]["dequantized_layers"] == 14
        disable_avx512bf16_repack(base)
    reference = PeftModel.from_pretrained(base, str(job / "adapter"))
    ids = torch.tensor([[1, 5, 17, 42, 99, 7, 300, 12]])
    a, b = logits(merged, ids), logits(reference, ids)
    diff = float((a - b).abs().max())
    print(f"{method}: merged vs adapter+base max abs logit diff {diff:.2e}")
    assert diff < LOGIT_TOLERANCE
    unmerged = logits(AutoModelForCausalLM.from_pretrained(str(tiny / "model"), local_files_only=True), ids)
    assert float((a - unmerged).abs().max()) > 100 * LOGIT_TOLERANCE, "the adapter changed the model"


def test_report_to_tensorboard_writes_event_files_or_says_what_is_missing(tiny, tmp_path):
    import importlib.util

    from trainq.watcher.spec.contract import EXIT_USAGE

    job = write_job(
        tmp_path / "job",
        tiny,
        max_steps=4,
        eval_every=2,
        log_every=2,
        report_to=["tensorboard"],
        checkpoint={"every_steps": 100},
    )
    if importlib.util.find_spec("tensorboard") or importlib.util.find_spec("tensorboardX"):
        assert run_trainer(job) == EXIT_OK, output(job)
        assert list((job / "tensorboard").glob("events.out.tfevents.*"))
        assert "{'loss'" not in output(job), "the Trainer's own log dicts stay out of the log"
    else:
        assert run_trainer(job) == EXIT_USAGE
        assert "train.report_to: tensorboard needs the tensorboard package" in output(job).strip().splitlines()[-1]
