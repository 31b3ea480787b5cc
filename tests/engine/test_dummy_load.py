"""`--load-format dummy` (SGLang's random weights from config.json alone, for benchmarks) also
builds the draft, as SGLang's built-in DFLASH does: a draft folder holding only its config
serves, and serves losslessly (the oracle: the plain engine on the same dummy target)."""

import os
import shutil

import pytest
import torch

from sglang_dflash.checkpoint.config import CheckpointError, DFlashDraftConfig
from sglang_dflash.draft.model import DFlashDraftModel
from tests.support import engines

pytestmark = pytest.mark.sglang


@pytest.fixture(scope="module")
def config_only_draft(tiny, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("dummy-draft"))
    shutil.copy(os.path.join(tiny.draft("a"), "config.json"), path)
    return path


def test_the_draft_is_built_from_its_config_alone(config_only_draft):
    from sglang.srt.model_loader.weight_utils import initialize_dummy_weights

    config = DFlashDraftConfig.from_pretrained(config_only_draft)
    model = DFlashDraftModel.from_pretrained(
        config_only_draft, config, 1, dtype=torch.bfloat16, init_weights=initialize_dummy_weights
    )
    params = list(model.parameters())
    assert params and all(p.dtype == torch.bfloat16 and p.device.type == "cpu" for p in params)
    assert all(p.abs().max() <= 1e-3 and p.abs().max() > 0 for p in params)  # SGLang's dummy range
    with pytest.raises(CheckpointError, match=r"no \*.safetensors"):  # else the weights are needed
        DFlashDraftModel.from_pretrained(config_only_draft, config, 1)


def test_dummy_weights_serve_losslessly(tiny, config_only_draft):
    prompts = engines.prompts(4, seed=9)
    sampling = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
    outputs = []
    for draft in (None, config_only_draft):
        engine = engines.start(tiny.target("a"), draft, 8, load_format="dummy")
        try:
            if draft is not None:
                assert engines.server_state(engine)["dflash_implementation"].startswith("sglang-dflash")
            outputs.append([o["output_ids"] for o in engines.generate(engine, prompts, sampling, 4)])
        finally:
            engines.shutdown(engine)
    assert outputs[0] == outputs[1]
