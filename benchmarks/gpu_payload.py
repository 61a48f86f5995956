"""What the GPU check's one device call carries beside the working tree (issue 49, point 3), and
the checkpoint its spec bench builds there.

A call carries at most 64 MiB with the working tree, whose tracked files are 32.8 MiB (the EAGLE
heads mostly): the embedded model's 98.4 MB GGUF does not fit, so the spec bench runs on random
weights of its real shape with its real tokenizer and chat template. `prepare` writes, here:

    OUT/model/config.json, tokenizer.json, tokenizer_config.json    the embedded model's (2.1 MB)
    OUT/provenance.json    the commit, the sha256 of `git diff HEAD` (uncommitted changes) and of
                           every tracked file's content, so the summary can say which code ran
                           (the device machine gets the files, not the repository)

    python benchmarks/gpu_payload.py prepare work/gpu [model.gguf]   # default: the embedded model's;
                                                                    # then carry work/gpu (docs/building.md)

There `random_checkpoint` writes a Hugging Face checkpoint directory of model/'s shape (or
smaller, the dry run's) with random weights, which `specdec build` reads like any other. What
the random weights cannot answer (acceptance, speedup by drafting) is the real model's and is
measured on the CPU; what they can (every output identical to plain, the step's time at this
shape) is the GPU's question.
"""
from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def model_files(gguf: Path, out: Path) -> Path:
    """config.json (Hugging Face's keys for a Llama), tokenizer.json and tokenizer_config.json of
    a Llama-family GGUF, in out/."""
    from backend.buildlib.checkpoint import load_checkpoint
    from backend.tokenizer import tokenizer_json_from_gguf

    ck = load_checkpoint(gguf)
    c, tok = ck.config, ck.tokenizer
    if c.architecture not in ("llama", "smollm") or c.rope_scaling is not None:
        raise ValueError(f"{gguf}: a plain Llama is what this writes a config for, not {c.architecture}")
    out.mkdir(parents=True, exist_ok=True)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": c.vocab_size,
              "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
              "num_hidden_layers": c.num_layers, "num_attention_heads": c.num_heads,
              "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim, "rms_norm_eps": c.rms_norm_eps,
              "rope_theta": c.rope_theta, "max_position_embeddings": c.max_position_embeddings,
              "tie_word_embeddings": c.tie_word_embeddings, "bos_token_id": c.bos_token_id,
              "eos_token_id": list(c.eos_token_ids)}
    (out / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    (out / "tokenizer.json").write_text(tok.tokenizer_json or tokenizer_json_from_gguf(tok.gguf_vocab))
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": tok.chat_template, "add_bos_token": tok.add_bos_token}) + "\n")
    return out


def _git(root: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=True).stdout


def files_sha256(root: Path, paths: list[str]) -> str:
    """One sha256 over every file's path and content, in the order given (missing: named)."""
    h = hashlib.sha256()
    for p in paths:
        f = root / p
        h.update(p.encode() + b"\0")
        h.update(hashlib.sha256(f.read_bytes()).digest() if f.is_file() else b"missing")
    return h.hexdigest()


def provenance(root: Path = ROOT) -> dict:
    """The code here: commit, the sha256 of the uncommitted changes (`git diff HEAD` and the
    untracked files that travel too; None: clean), the files that travel (tracked and untracked
    but not ignored: the list and their content hash, which the device machine recomputes)."""
    untracked = sorted(_git(root, "ls-files", "--others", "--exclude-standard").splitlines())
    files = sorted(_git(root, "ls-files").splitlines() + untracked)
    dirty = _git(root, "diff", "HEAD", "--binary").encode()
    if untracked:
        dirty += files_sha256(root, untracked).encode()
    return {"commit": _git(root, "rev-parse", "HEAD").strip(), "dirty_diff_sha256":
            hashlib.sha256(dirty).hexdigest() if dirty else None,
            "files": files, "files_sha256": files_sha256(root, files)}


def code_identity(carried: Path | None, root: Path = ROOT) -> dict:
    """Which code is running: from git where the repository is here; else from the carried
    provenance.json, its files hashed again here (`files_match`: the same bits as prepared)."""
    try:
        p = provenance(root)
        return {"commit": p["commit"], "dirty_diff_sha256": p["dirty_diff_sha256"], "how": "git here"}
    except (OSError, subprocess.CalledProcessError):
        pass
    if carried is None or not (carried / "provenance.json").exists():
        return {"commit": None, "how": "no git here and no provenance.json carried (gpu_payload.py prepare)"}
    p = json.loads((carried / "provenance.json").read_text())
    return {"commit": p["commit"], "dirty_diff_sha256": p["dirty_diff_sha256"], "how": "provenance.json carried",
            "files_match": files_sha256(root, p["files"]) == p["files_sha256"]}


def prepare(gguf: Path, out: Path) -> list[Path]:
    """The carry folder: model/ and provenance.json (module docstring)."""
    model_files(gguf, out / "model")
    (out / "provenance.json").write_text(json.dumps(provenance(), indent=1) + "\n")
    return sorted(p for p in out.rglob("*") if p.is_file())


def small_tokenizer(model: Path, dest: Path, vocab: int) -> None:
    """The dry run's tokenizer.json: a byte-level BPE of `vocab` ids trained here on the bench's
    prompts, with model/'s special tokens at their ids (its chat template then reads the same);
    the interpreter runs the LM head's columns a program at a time, and the real 49152 would
    cost seconds a token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from backend.bench.prompt_sets import default_prompts, load_prompts

    added = json.loads((model / "tokenizer.json").read_text())["added_tokens"]
    specials = [t["content"] for t in sorted(added, key=lambda t: t["id"]) if t["special"]]
    assert [t["id"] for t in sorted(added, key=lambda t: t["id"])][: len(specials)] == list(range(len(specials)))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    texts = [m["content"] for p in load_prompts(default_prompts()) for m in p["messages"]]
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab, special_tokens=specials,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(dest / "tokenizer.json"))


def random_checkpoint(model: Path, dest: Path, overrides: dict | None = None, seed: int = 0) -> Path:
    """A Hugging Face checkpoint in dest/: model/'s tokenizer files, its config.json with
    `overrides` (the dry run's small shape; a smaller vocab_size: small_tokenizer's), and
    model.safetensors of random bf16 weights (the scales of gpu_steps.random_tensors: embedding
    N(0, 1), linears N(0, 0.02), norms 1)."""
    import torch
    from safetensors.torch import save_file

    dest.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        shutil.copyfile(model / name, dest / name)
    cfg = {**json.loads((model / "config.json").read_text()), **(overrides or {})}
    if cfg["vocab_size"] < json.loads((model / "config.json").read_text())["vocab_size"]:
        small_tokenizer(model, dest, cfg["vocab_size"])
    (dest / "config.json").write_text(json.dumps(cfg, indent=1) + "\n")
    g = torch.Generator().manual_seed(seed)
    h, d, inter = cfg["hidden_size"], cfg["head_dim"], cfg["intermediate_size"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    rnd = lambda *shape, std=0.02: (torch.randn(*shape, generator=g) * std).to(torch.bfloat16)
    ones = lambda n: torch.ones(n, dtype=torch.bfloat16)
    t = {"model.embed_tokens.weight": rnd(cfg["vocab_size"], h, std=1.0), "model.norm.weight": ones(h)}
    if not cfg["tie_word_embeddings"]:
        t["lm_head.weight"] = rnd(cfg["vocab_size"], h)
    shapes = {"self_attn.q_proj": (nh * d, h), "self_attn.k_proj": (nkv * d, h), "self_attn.v_proj": (nkv * d, h),
              "self_attn.o_proj": (h, nh * d), "mlp.gate_proj": (inter, h), "mlp.up_proj": (inter, h),
              "mlp.down_proj": (h, inter)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = ones(h)
        t[p + "post_attention_layernorm.weight"] = ones(h)
        t.update({f"{p}{k}.weight": rnd(*s) for k, s in shapes.items()})
    save_file(t, str(dest / "model.safetensors"))
    return dest


if __name__ == "__main__":
    if len(sys.argv) not in (3, 4) or sys.argv[1] != "prepare":
        sys.exit(__doc__)
    sys.path.insert(0, str(ROOT))
    from backend.builder.embedded import default_gguf

    for p in prepare(Path(sys.argv[3] if len(sys.argv) == 4 else default_gguf()), Path(sys.argv[2])):
        print(p, p.stat().st_size)
