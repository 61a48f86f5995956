"""The native kernel's attention at the head sizes it compiles as constants (64, 128, 256: the
loops over a head's vectors unrolled, a row's keys and values converted once for all its nodes,
plugins/native/attention.c) and at another (32): a verify of several nodes gives each node the
bits a step of that node alone gives (the build's batch-invariance check, chain and tree, across
256 columns), and the logits follow transformers' on the same weights."""
import shutil

import numpy as np
import pytest

from backend.manifest import WeightFormat
from conftest import chain, make_tiny_checkpoint

native = pytest.importorskip("backend.runtime.native")
if not native.compiled():
    pytest.skip("the native kernel is not compiled", allow_module_level=True)
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tok") / "ckpt", layers=1)


@pytest.mark.parametrize("head_dim", [32, 64, 128, 256])
def test_a_verify_gives_each_node_its_single_step_bits_at_every_head_size(tmp_path, tokenizer_dir, head_dim):
    from backend.builder.pipeline import BuildConfig, build
    from backend.devices import load_runtime
    from backend.devices.native import NativeOptions

    ckpt = tmp_path / "ckpt"
    shutil.copytree(tokenizer_dir, ckpt)
    vocab = transformers.PreTrainedTokenizerFast(tokenizer_file=str(ckpt / "tokenizer.json")).vocab_size
    torch.manual_seed(head_dim)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=head_dim,
                                   max_position_embeddings=320, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
                                   initializer_range=0.08, tie_word_embeddings=False)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    hf.save_pretrained(ckpt)
    m = build(BuildConfig(target=str(ckpt), output=tmp_path / "repo", quiet=True, weights=(WeightFormat.GGUF,),
                          max_seq_len=300, measure_costs=False, options=(NativeOptions("none"),)))
    assert m.engine("gguf").batch_invariant is True          # verify forwards vs single steps, 0 difference
    ids = np.random.default_rng(head_dim).integers(3, vocab, 40)
    with torch.no_grad():
        ref = hf(torch.tensor([ids.tolist()])).logits[0].numpy()
    rt = load_runtime(m, "gguf")
    rt.alloc(0)
    out = rt.forward([0], ids[None], chain(ids.size), np.arange(ids.size)[None]).logits[0]
    rt.close()
    err = np.abs(out - ref).max() / np.abs(ref).max()
    assert err < 0.04             # Q8_0 weights, int8 activations: ~0.02 at every size here
