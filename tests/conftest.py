"""Shared fixtures: tiny checkpoints made in the test session (no downloads)."""

from __future__ import annotations

import os

import pytest
import torch

try:  # the dev extra's; property tests (tests/align) draw their examples with it
    from hypothesis import settings

    # Every run draws the same examples (a red CI means a change broke them, not a new draw);
    # DECODEKIT_EXPLORE=1 draws new ones, and keeps any that fail in .hypothesis/.
    settings.register_profile("fixed", derandomize=True, database=None)
    if not os.environ.get("DECODEKIT_EXPLORE"):
        settings.load_profile("fixed")
except ImportError:
    pass

TEXT = (
    "ROMEO: But soft, what light through yonder window breaks? It is the east, and Juliet is "
    "the sun. JULIET: O Romeo, Romeo, wherefore art thou Romeo? Deny thy father and refuse thy "
    "name. 0123456789 +-*/= The quick brown fox jumps over the lazy dog.\n"
)


@pytest.fixture(scope="session", autouse=True)
def dtype_probe_cache(tmp_path_factory):
    """The dtype probe's cache (models/dtype_probe.py) in the session's temporary directory, not
    the user's ~/.cache: a test that loads a bfloat16 checkpoint with dtype "auto" probes at
    most once per session and leaves nothing behind."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DECODEKIT_CACHE_DIR", str(tmp_path_factory.mktemp("decodekit-cache")))
        yield


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module's tests: tiny models gain nothing from intra-op threads,
    and on the shared test machine a second thread only waits for a busy core."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_text():
    """The text the tiny tokenizer was trained on (so a test can build models that know it)."""
    return TEXT


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    """A random 2-layer Llama with a byte-level BPE tokenizer (vocab ~300), saved as HF files."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    path = tmp_path_factory.mktemp("tiny-llama")
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator([TEXT] * 20, vocab_size=300, min_frequency=2, special_tokens=["<eos>"])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="<eos>")
    tokenizer.save_pretrained(path)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=96,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_lm(tiny_llama_dir):
    from decodekit.models.registry import load_model

    return load_model(tiny_llama_dir)


@pytest.fixture(scope="session")
def toy_lm():
    """A Llama over a 6-token vocabulary with no tokenizer (EOS = 0): small enough to enumerate."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from decodekit.models.hf import HFModelLM

    config = LlamaConfig(
        vocab_size=6, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16,
        eos_token_id=0, bos_token_id=None, pad_token_id=None,
    )
    torch.manual_seed(1)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # sharper distributions than the random init
    return HFModelLM(model, None, "toy")


@pytest.fixture
def torch_kernels_only(monkeypatch):
    """decodekit's native kernels off (models/kernels.py, DECODEKIT_KERNELS=0): the layers
    choose and run PyTorch's paths, as on a machine where the kernels are not built."""
    from decodekit.models import kernels

    monkeypatch.setenv(kernels.DISABLE_ENV, "0")
    kernels.status.cache_clear()
    yield
    monkeypatch.undo()
    kernels.status.cache_clear()


@pytest.fixture(scope="session")
def serve_process():
    """tests/serving.py's `served`, for test directories that cannot import it (tests/server)."""
    from serving import served

    return served
