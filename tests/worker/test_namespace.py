"""The block-hash namespace comes from what a checkpoint is, not where it lies: the same model
at ``/models/x`` on one host and ``./y`` on another hashes the same, a fine-tune does not."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from kvswitch.worker.engine import EngineConfig, LLMEngine
from kvswitch.worker.weights import model_namespace
from tests.worker.test_model import save_checkpoint


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    model_dir = tmp_path / "models" / "llama-small"
    save_checkpoint(model_dir, "llama")
    return model_dir


def test_a_copy_at_another_path_has_the_same_namespace(
    checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    namespace = model_namespace(checkpoint)
    assert namespace.startswith("llama-") and len(namespace) == len("llama-") + 16
    elsewhere = tmp_path / "other-host" / "renamed"
    shutil.copytree(checkpoint, elsewhere)
    monkeypatch.chdir(elsewhere.parent)
    assert model_namespace("renamed") == namespace
    assert model_namespace(Path("./renamed/")) == namespace
    assert LLMEngine(EngineConfig(model="renamed")).namespace == namespace


def test_other_weights_or_another_config_are_another_model(
    checkpoint: Path, tmp_path: Path
) -> None:
    namespace = model_namespace(checkpoint)
    fine_tune = tmp_path / "fine-tune"
    shutil.copytree(checkpoint, fine_tune)
    (weights,) = fine_tune.glob("*.safetensors")
    tensors = load_file(weights)
    tensors = {name: tensor * 1.01 for name, tensor in tensors.items()}
    save_file(tensors, weights, metadata={"format": "pt"})
    assert model_namespace(fine_tune) != namespace

    longer = tmp_path / "longer-context"
    shutil.copytree(checkpoint, longer)
    config = json.loads((longer / "config.json").read_text())
    config["max_position_embeddings"] *= 2
    (longer / "config.json").write_text(json.dumps(config))
    assert model_namespace(longer) != namespace


def test_an_operator_given_name_wins(checkpoint: Path) -> None:
    assert model_namespace(checkpoint, "llama-small-v2") == "llama-small-v2"
    engine = LLMEngine(EngineConfig(model=str(checkpoint), served_model_name="llama-small-v2"))
    assert engine.namespace == "llama-small-v2"
    assert model_namespace(None) == "kvswitch-tiny"
    assert model_namespace("random:llama-1b") == "random-llama-1b"
