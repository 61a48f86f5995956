"""`specdec train-draft`: train the EAGLE-style draft head for a built target, on CPU.

    prompts (stdlib docs) -> responses (the target) -> features (teacher-forced target)
    -> training (torch; resumable checkpoints) -> head directory (fp16 weights, config, plot)

Loss per position t, for the pair (f_t, x_{t+1}) (EAGLE): SmoothL1(f^_{t+1}, f_{t+1}) plus a
soft cross-entropy of the draft logits against the target's top-k distribution for x_{t+2}
(restricted to the draft vocabulary). A second pass feeds the head its own predicted features
(EAGLE-3's training-time test, one extra step) so that deeper draft steps are trained on the
inputs they see at serve time. Inputs get small uniform noise (EAGLE).
"""
from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

HEAD_WEIGHTS = "head.safetensors"
HEAD_CONFIG = "config.json"


@dataclass
class TrainConfig:
    out: Path                      # the head directory (small: weights, config, plot)
    engine_dir: Path               # the built target
    work: Path                     # data and resumable checkpoints (large, not committed)
    num_prompts: int = 1200
    max_new_tokens: int = 160
    draft_vocab: int = 8192
    window: int = 256
    batch: int = 8
    lr: float = 6e-4
    epochs: int = 6
    minutes: float = 30.0          # training budget (data generation not included)
    noise: float = 0.1
    seed: int = 0
    gen_format: str | None = None  # weight format for generating responses (default: fastest)


def _sequences(shards: list[Path]):
    """Sequences from the feature shards, each position's top-k sorted best first."""
    seqs = []
    for p in shards:
        z = np.load(p)
        order = np.argsort(-z["top_p"].astype(np.float32), axis=-1, kind="stable")
        top_ids = np.take_along_axis(z["top_ids"], order, -1)
        top_p = np.take_along_axis(z["top_p"], order, -1)
        off = z["offsets"]
        for a, b, pl in zip(off[:-1], off[1:], z["prompt_lens"]):
            seqs.append({"tokens": z["tokens"][a:b], "feats": z["feats"][a:b], "top_ids": top_ids[a:b],
                         "top_p": top_p[a:b], "prompt_len": int(pl)})
    return seqs


def choose_vocab(seqs, size: int, vocab_total: int) -> np.ndarray:
    """The `size` tokens the target most often predicts or emits (FR-Spec), sorted by id."""
    counts = np.zeros(vocab_total, np.float64)
    for s in seqs:
        np.add.at(counts, s["top_ids"][:, 0], 1.0)
        np.add.at(counts, s["tokens"][s["prompt_len"]:], 1.0)
        np.add.at(counts, s["top_ids"][:, 1:].reshape(-1), 0.1)
    return np.sort(np.argsort(-counts, kind="stable")[:size]).astype(np.int64)


def _batches(seqs, window: int, batch: int, rng: np.random.Generator):
    wins = [(i, a) for i, s in enumerate(seqs) for a in range(0, max(1, len(s["tokens"]) - 2), window)]
    order = rng.permutation(len(wins))
    for k in range(0, len(order), batch):
        yield [wins[j] for j in order[k: k + batch]]


def _tensors(seqs, wins, window: int, vocab_map: np.ndarray, feat_std: float, noise: float, rng):
    import torch

    n = len(wins)
    t = min(window, max(len(seqs[i]["tokens"]) - 1 - a for i, a in wins))
    t = max(t, 1)
    h = seqs[0]["feats"].shape[1]
    f_in = np.zeros((n, t, h), np.float32)
    f_out = np.zeros((n, t, h), np.float32)
    tok = np.zeros((n, t), np.int64)
    pos = np.zeros((n, t), np.int64)
    tid = np.zeros((n, t, 8), np.int64)
    tp = np.zeros((n, t, 8), np.float32)
    valid = np.zeros((n, t), np.float32)
    for r, (i, a) in enumerate(wins):
        s = seqs[i]
        m = min(t, len(s["tokens"]) - 1 - a)
        f_in[r, :m] = s["feats"][a:a + m]
        f_out[r, :m] = s["feats"][a + 1:a + 1 + m]
        tok[r, :m] = s["tokens"][a + 1:a + 1 + m]
        pos[r, :m] = np.arange(a, a + m)
        ids = s["top_ids"][a + 1:a + 1 + m]
        tid[r, :m] = vocab_map[ids]
        tp[r, :m] = s["top_p"][a + 1:a + 1 + m] * (vocab_map[ids] >= 0)
        valid[r, :m] = 1.0
    tp = tp / np.maximum(tp.sum(-1, keepdims=True), 1e-6)
    f_noisy = f_in + rng.uniform(-noise, noise, f_in.shape).astype(np.float32) * feat_std
    T = lambda x: torch.from_numpy(x)
    return T(f_noisy), T(f_in), T(f_out), T(tok), T(pos), T(np.maximum(tid, 0)), T(tp), T(valid)


def _losses(model, f_in, tok, pos, f_out, tid, tp, valid, mask):
    import torch

    feat, logits = model(f_in, tok, pos, mask)
    w = valid[..., None]
    reg = (torch.nn.functional.smooth_l1_loss(feat, f_out, reduction="none") * w).sum() / (w.sum() * feat.shape[-1])
    logp = torch.log_softmax(logits, -1)
    cls = -(torch.gather(logp, -1, tid) * tp).sum(-1)
    cls = (cls * valid).sum() / valid.sum()
    acc = ((logits.argmax(-1) == tid[..., 0]) & (tp[..., 0] > 0)).float()
    acc = (acc * valid).sum() / valid.sum()
    return feat, reg, cls, acc


def train(cfg: TrainConfig) -> Path:
    import torch

    from backend.build.checkpoint import load_checkpoint
    from backend.build.graph import rope_tables
    from backend.manifest import EngineManifest
    from backend.train.data import extract_features, generate_responses
    from backend.train.eagle_model import EagleHead, causal_mask
    from backend.train.prompts import build_prompts

    torch.manual_seed(cfg.seed)
    torch.set_num_threads(2)
    out, work = Path(cfg.out), Path(cfg.work)
    out.mkdir(parents=True, exist_ok=True)
    (work / "data").mkdir(parents=True, exist_ok=True)
    manifest = EngineManifest.load(cfg.engine_dir)
    gen_fmt = cfg.gen_format or ("q4" if "q4" in manifest.engines else manifest.default_format.value)
    t0 = time.time()
    from backend.train.prompts import tokenizer_words

    words = tokenizer_words(manifest.resolve(manifest.tokenizer_path).read_text())
    prompts = build_prompts(cfg.num_prompts, cfg.seed, words)
    recs = generate_responses(cfg.engine_dir, prompts, work / "data" / "responses.jsonl", gen_fmt,
                              cfg.max_new_tokens)
    shards = extract_features(cfg.engine_dir, recs, work / "data" / "features", manifest.default_format.value)
    t_data = time.time() - t0
    seqs = _sequences(shards)
    mc = manifest.model
    vocab = choose_vocab(seqs, cfg.draft_vocab, mc.vocab_size)
    vocab_map = np.full(mc.vocab_size, -1, np.int64)
    vocab_map[vocab] = np.arange(vocab.size)
    ck = load_checkpoint(manifest.source)
    embed = ck.tensor("embed").float32()
    head_rows = ck.tensors.get("lm_head", ck.tensor("embed")).float32()[vocab]
    cos, sin = rope_tables(mc, manifest.max_seq_len)
    hcfg = {"hidden_size": mc.hidden_size, "num_heads": mc.num_heads, "num_kv_heads": mc.num_kv_heads,
            "head_dim": mc.head_dim, "intermediate_size": mc.intermediate_size,
            "rms_norm_eps": mc.rms_norm_eps, "rope_theta": mc.rope_theta,
            "draft_vocab_size": int(vocab.size), "target_vocab_size": mc.vocab_size}
    model = EagleHead(hcfg, embed, head_rows.astype(np.float32), cos, sin)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    feat_std = float(np.sqrt(np.mean([np.mean(s["feats"][:512].astype(np.float32) ** 2) for s in seqs[:64]])))
    rng = np.random.default_rng(cfg.seed)
    n_tok = sum(len(s["tokens"]) for s in seqs)
    steps_per_epoch = math.ceil(sum(max(1, math.ceil((len(s["tokens"]) - 2) / cfg.window)) for s in seqs) / cfg.batch)
    total_steps = steps_per_epoch * cfg.epochs
    ckpt_path = work / "checkpoint.pt"
    state = {"step": 0, "epoch": 0, "history": []}
    if ckpt_path.exists():
        saved = torch.load(ckpt_path, weights_only=False)
        model.load_state_dict(saved["model"], strict=False)
        opt.load_state_dict(saved["opt"])
        state = saved["state"]
        print(f"resuming at step {state['step']} (epoch {state['epoch']})", file=sys.stderr)
    print(f"data: {len(seqs)} sequences, {n_tok} tokens ({t_data:.0f}s); draft vocab {vocab.size} covers "
          f"{_coverage(seqs, vocab_map):.1%} of target top-1; {total_steps} steps planned", file=sys.stderr)
    from tqdm import tqdm

    bar = tqdm(total=total_steps, initial=state["step"], desc="train", unit="step", file=sys.stderr)
    t_train, deadline = time.time(), time.time() + cfg.minutes * 60
    stop = False
    while state["epoch"] < cfg.epochs and not stop:
        erng = np.random.default_rng(cfg.seed + state["epoch"])
        for k, wins in enumerate(_batches(seqs, cfg.window, cfg.batch, erng)):
            if k < state["step"] - state["epoch"] * steps_per_epoch:
                continue                                   # resumed mid-epoch
            lr = cfg.lr * min(1.0, (state["step"] + 1) / 50) * 0.5 * (1 + math.cos(math.pi * min(1.0, state["step"] / total_steps)))
            for g in opt.param_groups:
                g["lr"] = lr
            f_noisy, f_in, f_out, tok, pos, tid, tp, valid = _tensors(seqs, wins, cfg.window, vocab_map, feat_std, cfg.noise, rng)
            mask = causal_mask(tok.shape[1])
            feat1, reg1, cls1, acc1 = _losses(model, f_noisy, tok, pos, f_out, tid, tp, valid, mask)
            f2 = torch.cat([f_in[:, :1], feat1[:, :-1]], dim=1)      # own predictions as inputs
            _, reg2, cls2, acc2 = _losses(model, f2, tok, pos, f_out, tid, tp, valid, mask)
            loss = reg1 + cls1 + 0.5 * (reg2 + cls2)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            state["step"] += 1
            state["history"].append([state["step"], float(loss), float(cls1), float(acc1), float(acc2)])
            bar.update(1)
            bar.set_postfix(loss=f"{float(loss):.3f}", acc=f"{float(acc1):.3f}", acc2=f"{float(acc2):.3f}")
            if state["step"] % 50 == 0:
                torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "state": state}, ckpt_path)
            if time.time() > deadline:
                stop = True
                break
        else:
            state["epoch"] += 1
    bar.close()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "state": state}, ckpt_path)
    meta = {"data_seconds": round(t_data), "train_seconds": round(time.time() - t_train), "tokens": n_tok,
            "sequences": len(seqs), "steps": state["step"], "epochs_done": state["epoch"],
            "final_acc": float(np.mean([h[3] for h in state["history"][-20:]])),
            "final_acc2": float(np.mean([h[4] for h in state["history"][-20:]])), "config": {
                k: (str(v) if isinstance(v, Path) else v) for k, v in cfg.__dict__.items()}}
    save_head(out, model, hcfg, vocab, manifest, meta)
    _plot(state["history"], out / "training.png")
    return out


def _coverage(seqs, vocab_map) -> float:
    top1 = np.concatenate([s["top_ids"][:, 0] for s in seqs])
    return float(np.mean(vocab_map[top1] >= 0))


def save_head(out: Path, model, hcfg: dict, vocab: np.ndarray, manifest, meta: dict) -> None:
    from safetensors.numpy import save_file

    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.astype(np.float16) for k, v in model.export_weights().items()}
    tensors["draft_vocab"] = vocab.astype(np.int64)
    save_file(tensors, str(out / HEAD_WEIGHTS))
    cfg = dict(hcfg, target_source=Path(manifest.source).name, target_architecture=manifest.model.architecture,
               target_hidden_size=manifest.model.hidden_size, training=meta)
    (out / HEAD_CONFIG).write_text(json.dumps(cfg, indent=2) + "\n")


def load_head(head_dir: Path) -> tuple[dict, dict[str, np.ndarray]]:
    from safetensors.numpy import load_file

    cfg = json.loads((Path(head_dir) / HEAD_CONFIG).read_text())
    return cfg, load_file(str(Path(head_dir) / HEAD_WEIGHTS))


def _plot(history, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    h = np.asarray(history)
    if h.size == 0:
        return
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    k = max(1, len(h) // 100)
    smooth = lambda x: np.convolve(x, np.ones(k) / k, mode="valid")
    a.plot(smooth(h[:, 1]), label="total loss")
    a.plot(smooth(h[:, 2]), label="cross-entropy (step 1)")
    a.set_xlabel("step")
    a.legend()
    b.plot(smooth(h[:, 3]), label="top-1 accuracy, step 1")
    b.plot(smooth(h[:, 4]), label="top-1 accuracy, step 2 (own features)")
    b.set_xlabel("step")
    b.legend()
    fig.suptitle("EAGLE draft head training")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
