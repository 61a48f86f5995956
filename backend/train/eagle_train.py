"""`specdec train-draft`: train the EAGLE-style draft head for a built target, on CPU.

    fixed text (corpus.py) [+ the target's own answers] -> features (teacher-forced target)
    -> training (torch; resumable checkpoints; validated on held-out chat answers)
    -> head directory (fp16 weights of the best validation checkpoint, config, plot)

Loss per position t, for the pair (f_t, x_{t+1}) (EAGLE): SmoothL1(f^_{t+1}, f_{t+1}) plus the
forward KL of the draft logits to the target's distribution for x_{t+2} over the draft
vocabulary (recomputed from f_{t+1} and the target's LM head). Further passes (`ttt_steps`) feed
the head its own predicted features of the pass before (EAGLE-3's training-time test), so that
deeper draft steps are trained on the inputs they see at serve time. Inputs get small uniform
noise (EAGLE).

`eagle3`: an EAGLE-3 head (train/eagle_model.Eagle3Head) on the target's low, middle and high
layer features (the reference's layers (2, L/2, L-3), extracted by the native or torch runtime),
with the KL loss only (its output is its own feature space, not the target's), written in the
EAGLE-3 reference's layout.
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
    corpus_tokens: int = 3_000_000  # fixed text (corpus.py), labelled by the target
    num_prompts: int = 600         # plus the target's own answers to this many chat prompts
    own_repeat: int = 1            # ... each seen this many times per epoch (oversampling)
    max_new_tokens: int = 160
    draft_vocab: int = 8192
    window: int = 256
    batch: int = 8
    lr: float = 6e-4
    epochs: int = 1
    minutes: float = 45.0          # training budget (data generation not included)
    noise: float = 0.1
    ttt_steps: int = 2             # extra passes on the head's own predicted features
    seed: int = 0
    val_prompts: int = 48          # held-out chat questions, answered by the target
    val_every: int = 100           # steps between validations (and the curve's points)
    gen_format: str | None = None  # weight format for generating answers (default: fastest)
    corpus_roots: list[str] | None = None  # directories of .py files (default: stdlib + packages)
    init: Path | None = None       # start from this head's weights (same vocabulary size)
    vocab_from: Path | None = None  # take the draft vocabulary of this head instead of choosing one
    eagle3: bool = False           # an EAGLE-3 head on three layers' features (module docstring)


def _load_shards(shards: list[Path], source: str = "") -> list[dict]:
    """Sequences of the feature shards (data.extract_hidden): tokens, fp16 features, and the
    target's full-vocabulary argmax where probed (-1 elsewhere)."""
    seqs = []
    for p in shards:
        z = np.load(p)
        tokens, feats, off = z["tokens"], z["feats"], z["offsets"]
        top1 = np.full(tokens.size, -1, np.int32)
        top1[z["probe_pos"]] = z["probe_top1"]
        for a, b, pl in zip(off[:-1], off[1:], z["prompt_lens"]):
            seqs.append({"tokens": tokens[a:b], "feats": feats[a:b], "top1": top1[a:b], "prompt_len": int(pl),
                         "source": source})
    return seqs


def choose_vocab(seqs, size: int, vocab_total: int) -> np.ndarray:
    """The `size` tokens the target most often predicts (FR-Spec), then those the answers use,
    sorted by id. Each data source (fixed text, the target's own chat answers) counts as much
    as the other, whatever its size: 3M tokens of docstrings alone fill the vocabulary with
    identifiers (measured: 91% of the target's top-1 on chat answers covered, against 99%)."""
    counts = np.zeros(vocab_total, np.float64)
    for source in sorted({s["source"] for s in seqs}):
        c = np.zeros(vocab_total, np.float64)
        for s in (s for s in seqs if s["source"] == source):
            np.add.at(c, s["top1"][s["top1"] >= 0], 1.0)
            np.add.at(c, s["tokens"][s["prompt_len"]:], 0.01)
        counts += c / max(c.sum(), 1.0)
    return np.sort(np.argsort(-counts, kind="stable")[:size]).astype(np.int64)


def _windows(seqs, window: int) -> list[tuple[int, int]]:
    return [(i, a) for i, s in enumerate(seqs) for a in range(0, max(1, len(s["tokens"]) - 2), window)]


def _batches(seqs, window: int, batch: int, rng: np.random.Generator, pool: int = 64):
    """Shuffled batches of windows of similar length (sorted within pools of `pool` batches),
    so that short windows are not padded to full ones (a quarter of the work otherwise)."""
    wins = _windows(seqs, window)
    length = lambda w: min(window, len(seqs[w[0]]["tokens"]) - 2 - w[1])
    order = [wins[j] for j in rng.permutation(len(wins))]
    batches = []
    for p in range(0, len(order), batch * pool):
        chunk = sorted(order[p: p + batch * pool], key=length)
        batches += [chunk[k: k + batch] for k in range(0, len(chunk), batch)]
    for j in rng.permutation(len(batches)):
        yield batches[j]


def _tensors(seqs, wins, window: int, feat_std: float, noise: float, rng, hidden: int):
    """Row r, column k: the pair (f_{a+k}, x_{a+k+1}) in, the target's final-norm feature
    f_{a+k+1} out (whose LM-head distribution labels x_{a+k+2}). Stored rows of width `hidden`
    are both; wider ones (EAGLE-3) are [final norm | layer features]: the layer features in."""
    import torch

    n = len(wins)
    t = max(1, min(window, max(len(seqs[i]["tokens"]) - 2 - a for i, a in wins)))
    w = seqs[0]["feats"].shape[1]
    cols = slice(0, hidden) if w == hidden else slice(hidden, w)
    f_in = np.zeros((n, t, cols.stop - cols.start), np.float32)
    f_out = np.zeros((n, t, hidden), np.float32)
    tok = np.zeros((n, t), np.int64)
    pos = np.zeros((n, t), np.int64)
    valid = np.zeros((n, t), np.float32)
    for r, (i, a) in enumerate(wins):
        s = seqs[i]
        m = max(0, min(t, len(s["tokens"]) - 2 - a))
        f_in[r, :m] = s["feats"][a:a + m, cols]
        f_out[r, :m] = s["feats"][a + 1:a + 1 + m, :hidden]
        tok[r, :m] = s["tokens"][a + 1:a + 1 + m]
        pos[r, :m] = np.arange(a, a + m)
        valid[r, :m] = 1.0
    f_noisy = f_in + rng.uniform(-noise, noise, f_in.shape).astype(np.float32) * feat_std
    T = torch.from_numpy
    return T(f_noisy), T(f_in), T(f_out), T(tok), T(pos), T(valid)


def target_probs(model, f_out):
    """The target's distribution over the draft vocabulary, recomputed from its feature with the
    frozen LM-head rows (tokens outside the draft vocabulary masked: renormalised over it)."""
    import torch

    with torch.no_grad():
        return torch.softmax(f_out @ model.head.T, -1)


def _losses(model, f_in, tok, pos, f_out, p, valid, mask):
    """Feature regression (SmoothL1; not for EAGLE-3, whose features are its own) and forward KL
    to the target's distribution `p`."""
    import torch

    from backend.train.eagle_model import Eagle3Head

    feat, logits = model(f_in, tok, pos, mask)
    w = valid[..., None]
    if isinstance(model, Eagle3Head):
        reg = torch.zeros((), device=feat.device)
    else:
        reg = (torch.nn.functional.smooth_l1_loss(feat, f_out, reduction="none") * w).sum() / (w.sum() * feat.shape[-1])
    cls = -(p * torch.log_softmax(logits, -1)).sum(-1)
    cls = (cls * valid).sum() / valid.sum()
    acc = (logits.argmax(-1) == p.argmax(-1)).float()
    acc = (acc * valid).sum() / valid.sum()
    return feat, reg, cls, acc


def validate(model, seqs, vocab: np.ndarray) -> dict:
    """Greedy acceptance of a head on held-out answers, teacher-forced: at depth 1 the head sees
    the target's feature (as after a verification), at depth 2 its own predicted feature; a
    position counts when the head's top token equals the target's full-vocabulary argmax."""
    import torch

    from backend.train.eagle_model import causal_mask

    hit1 = hit2 = n = 0
    dev = model.head.device
    h = model.head.shape[1]
    vocab_t = torch.from_numpy(vocab).to(dev)
    with torch.no_grad():
        for s in seqs:
            lo, t = s["prompt_len"], len(s["tokens"]) - 2
            if t - lo < 2:
                continue
            f = s["feats"][:t]
            f = torch.from_numpy((f if f.shape[1] == h else f[:, h:]).astype(np.float32))[None].to(dev)
            tok = torch.from_numpy(s["tokens"][1:t + 1].astype(np.int64))[None].to(dev)
            pos = torch.arange(t, device=dev)[None]
            target = torch.from_numpy(s["top1"][1:t + 1].astype(np.int64)).to(dev)
            mask = causal_mask(t).to(dev)
            feat1, logits1 = model(f, tok, pos, mask)
            f2 = torch.cat([model.fuse(f[:, :1]), feat1[:, :-1]], 1)
            _, logits2 = model(f2, tok, pos, mask)
            keep = slice(lo, t)
            hit1 += int((vocab_t[logits1[0].argmax(-1)] == target)[keep].sum())
            hit2 += int((vocab_t[logits2[0].argmax(-1)] == target)[keep].sum())
            n += t - lo
    a1, a2 = hit1 / max(n, 1), hit2 / max(n, 1)
    return {"acc1": a1, "acc2": a2, "score": a1 + a1 * a2, "positions": n}


def eagle3_layers(num_layers: int) -> tuple[int, ...]:
    """The target layers an EAGLE-3 head trained here reads: the reference's default."""
    from backend.buildlib.heads.formats import feature_layers

    return feature_layers({"layout": "eagle3"}, num_layers)


def prepare_data(cfg: TrainConfig, manifest, tok) -> tuple[dict[str, list[Path]], list[Path], float]:
    """The three datasets, each resumable: the corpus, the target's own answers to training
    prompts (optional), and the held-out validation answers -> ({source: shards}, validation
    shards, seconds)."""
    from backend.train.corpus import corpus_records
    from backend.train.data import extract_hidden, generate_responses
    from backend.buildlib.prompts import GENERAL_FROM, build_prompts, tokenizer_words, validation_prompts

    work, t0 = Path(cfg.work) / "data", time.time()
    work.mkdir(parents=True, exist_ok=True)
    fast = [f for f in ("gguf", "q4") if f in manifest.engines]     # generation: the fastest engine built
    gen_fmt = cfg.gen_format or (fast[0] if fast else manifest.default_format.value)
    feat_fmt = manifest.default_format.value
    layers = eagle3_layers(manifest.model.num_layers) if cfg.eagle3 else ()
    if layers and feat_fmt != "gguf" and manifest.device.value != "cuda":
        raise ValueError("an EAGLE-3 head's features come from the native (gguf) or torch engine; "
                         f"this repository serves {feat_fmt}")
    extract = lambda recs, d, **kw: extract_hidden(cfg.engine_dir, recs, work / (d + ("_eagle3" if layers else "")),
                                                   feat_fmt, feature_layers=layers, **kw)
    words = tokenizer_words(manifest.resolve(manifest.tokenizer_path).read_text())
    max_prompt = min(900, manifest.max_seq_len - cfg.max_new_tokens - 1)
    val = generate_responses(cfg.engine_dir, validation_prompts(cfg.val_prompts, words),
                             work / "validation.jsonl", gen_fmt, cfg.max_new_tokens, sampled_fraction=0.0,
                             max_prompt=max_prompt)
    val_shards = extract(val, "val_features", probe_every=1)
    shards = {}
    if cfg.corpus_tokens:
        recs = corpus_records(tok, cfg.corpus_tokens, work / "corpus.jsonl", cfg.seed,
                              min(512, manifest.max_seq_len), cfg.corpus_roots)
        shards["corpus"] = extract(recs, "features")
    if cfg.num_prompts:
        chat = build_prompts(GENERAL_FROM + cfg.num_prompts, cfg.seed, words)[GENERAL_FROM:]
        own = generate_responses(cfg.engine_dir, chat, work / "responses.jsonl", gen_fmt, cfg.max_new_tokens,
                                 max_prompt=max_prompt)
        shards["own"] = extract(own, "own_features")
    return shards, val_shards, time.time() - t0


def train(cfg: TrainConfig) -> Path:
    import torch

    from backend.buildlib.checkpoint import load_checkpoint
    from backend.engine_format import rope_tables
    from backend.manifest import EngineManifest
    from backend.tokenizer import Tokenizer
    from backend.train.eagle_model import Eagle3Head, EagleHead, causal_mask

    torch.manual_seed(cfg.seed)
    torch.set_num_threads(2)
    out, work = Path(cfg.out), Path(cfg.work)
    out.mkdir(parents=True, exist_ok=True)
    manifest = EngineManifest.load(cfg.engine_dir)
    shards, val_shards, t_data = prepare_data(cfg, manifest, Tokenizer.from_manifest(manifest))
    seqs = [q for source, paths in shards.items() for q in _load_shards(paths, source)]
    n_tok = sum(len(s["tokens"]) for s in seqs)                     # distinct tokens
    seqs += [q for q in seqs if q["source"] == "own"] * (cfg.own_repeat - 1)
    val_seqs = _load_shards(val_shards, "validation")
    if not seqs:
        raise ValueError("no training data: set corpus_tokens (--corpus-tokens) or num_prompts (--prompts)")
    mc = manifest.model
    if cfg.vocab_from:
        vocab = np.sort(load_head(Path(cfg.vocab_from))[1]["draft_vocab"].astype(np.int64))
    else:
        vocab = choose_vocab(seqs, cfg.draft_vocab, mc.vocab_size)
    ck = load_checkpoint(manifest.source)
    embed = ck.tensor("embed").float32()
    head_rows = ck.tensors.get("lm_head", ck.tensor("embed")).float32()[vocab]
    cos, sin = rope_tables(mc.llama_layer(), manifest.max_seq_len)   # the head is a Llama layer
    hcfg = {"hidden_size": mc.hidden_size, "num_heads": mc.num_heads, "num_kv_heads": mc.num_kv_heads,
            "head_dim": mc.head_dim, "intermediate_size": mc.intermediate_size,
            "rms_norm_eps": mc.rms_norm_eps, "rope_theta": mc.rope_theta,
            "draft_vocab_size": int(vocab.size), "target_vocab_size": mc.vocab_size}
    if cfg.eagle3:
        hcfg["feature_layers"] = list(eagle3_layers(mc.num_layers))
    model = (Eagle3Head if cfg.eagle3 else EagleHead)(hcfg, embed, head_rows.astype(np.float32), cos, sin)
    if cfg.init:
        model.load_weights(load_head(Path(cfg.init))[1])
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")   # a GPU when at hand
    model.to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    h_in = slice(0, mc.hidden_size) if seqs[0]["feats"].shape[1] == mc.hidden_size else slice(mc.hidden_size, None)
    feat_std = float(np.sqrt(np.mean([np.mean(s["feats"][:512, h_in].astype(np.float32) ** 2) for s in seqs[:64]])))
    rng = np.random.default_rng(cfg.seed)
    steps_per_epoch = math.ceil(len(_windows(seqs, cfg.window)) / cfg.batch)   # what _batches yields
    total_steps = steps_per_epoch * cfg.epochs
    ckpt_path, best_path = work / "checkpoint.pt", work / "best.pt"
    state = {"step": 0, "epoch": 0, "history": [], "validation": [], "best": None, "tokens_seen": 0}
    if ckpt_path.exists():
        saved = torch.load(ckpt_path, weights_only=False)
        model.load_state_dict({k: v.to(dev) for k, v in saved["model"].items()}, strict=False)
        opt.load_state_dict(saved["opt"])
        state = saved["state"]
        print(f"resuming at step {state['step']} (epoch {state['epoch']})", file=sys.stderr)
    val_top1 = np.concatenate([s["top1"][s["prompt_len"]:] for s in val_seqs])
    vocab_map = np.full(mc.vocab_size, -1, np.int64)
    vocab_map[vocab] = np.arange(vocab.size)
    print(f"data: {len(seqs)} sequences, {n_tok} tokens ({t_data:.0f}s); draft vocab {vocab.size} covers "
          f"{np.mean(vocab_map[val_top1[val_top1 >= 0]] >= 0):.1%} of the target's top-1 on the validation "
          f"answers; {total_steps} steps planned", file=sys.stderr)

    def check():
        model.eval()
        v = validate(model, val_seqs, vocab)
        model.train()
        v.update(step=state["step"], tokens=state["tokens_seen"])
        state["validation"].append(v)
        if state["best"] is None or v["score"] > state["best"]["score"]:
            state["best"] = v
            torch.save(model.state_dict(), best_path)
        print(f"validation at {state['tokens_seen']} tokens: acc1 {v['acc1']:.3f} acc2 {v['acc2']:.3f}",
              file=sys.stderr)

    if not state["validation"]:
        check()
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
            f_noisy, f_in, f_out, tok, pos, valid = (x.to(dev) for x in _tensors(
                seqs, wins, cfg.window, feat_std, cfg.noise, rng, mc.hidden_size))
            mask = causal_mask(tok.shape[1]).to(dev)
            p = target_probs(model, f_out)
            feat, reg1, cls1, acc1 = _losses(model, f_noisy, tok, pos, f_out, p, valid, mask)
            loss, accs = reg1 + cls1, [acc1]
            for _ in range(cfg.ttt_steps):        # training-time test: own predictions as inputs
                f_own = torch.cat([model.fuse(f_in[:, :1]), feat[:, :-1]], dim=1)
                feat, reg, cls, acc = _losses(model, f_own, tok, pos, f_out, p, valid, mask)
                loss, accs = loss + 0.5 * (reg + cls), accs + [acc]
            acc2 = accs[min(1, len(accs) - 1)]
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            state["step"] += 1
            state["tokens_seen"] += int(valid.sum())
            state["history"].append([state["step"], loss.item(), cls1.item(), acc1.item(), acc2.item()])
            bar.update(1)
            bar.set_postfix(loss=f"{loss.item():.3f}", acc=f"{acc1.item():.3f}", acc2=f"{acc2.item():.3f}")
            if state["step"] % cfg.val_every == 0:
                check()
            if state["step"] % 50 == 0:
                torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "state": state}, ckpt_path)
            if time.time() > deadline:
                stop = True
                break
        else:
            state["epoch"] += 1
    bar.close()
    if state["validation"][-1]["step"] != state["step"]:
        check()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "state": state}, ckpt_path)
    model.load_state_dict(torch.load(best_path, weights_only=False))
    model.cpu()
    meta = {"data_seconds": round(t_data), "train_seconds": round(time.time() - t_train), "tokens": n_tok,
            "sequences": len(seqs), "steps": state["step"], "epochs_done": state["epoch"],
            "validation_best": state["best"], "validation_curve": state["validation"],
            "final_acc": float(np.mean([h[3] for h in state["history"][-20:]])) if state["history"] else None,
            "final_acc2": float(np.mean([h[4] for h in state["history"][-20:]])) if state["history"] else None,
            "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in cfg.__dict__.items()}}
    (save_eagle3 if cfg.eagle3 else save_head)(out, model, hcfg, vocab, manifest, meta)
    _plot(state["history"], state["validation"], out / "training.png")
    return out


def save_head(out: Path, model, hcfg: dict, vocab: np.ndarray, manifest, meta: dict) -> None:
    from safetensors.numpy import save_file

    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.astype(np.float16) for k, v in model.export_weights().items()}
    tensors["draft_vocab"] = vocab.astype(np.int64)
    save_file(tensors, str(out / HEAD_WEIGHTS))
    cfg = dict(hcfg, target_source=Path(manifest.source).name, target_architecture=manifest.model.architecture,
               target_hidden_size=manifest.model.hidden_size, training=meta)
    (out / HEAD_CONFIG).write_text(json.dumps(cfg, indent=2) + "\n")


def save_eagle3(out: Path, model, hcfg: dict, vocab: np.ndarray, manifest, meta: dict) -> None:
    """An EAGLE-3 head in the reference's layout: config.json (LlamaForCausalLMEagle3, the target's
    vocab_size, draft_vocab_size, the feature layers) + model.safetensors (its key names, fp16,
    d2t = target id - draft id)."""
    from safetensors.numpy import save_file

    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.astype(np.float16) for k, v in model.export_weights().items()}
    tensors["d2t"] = (vocab - np.arange(vocab.size)).astype(np.int64)
    save_file(tensors, str(out / "model.safetensors"))
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
           "hidden_size": hcfg["hidden_size"], "intermediate_size": hcfg["intermediate_size"],
           "num_attention_heads": hcfg["num_heads"], "num_key_value_heads": hcfg["num_kv_heads"],
           "head_dim": hcfg["head_dim"], "rms_norm_eps": hcfg["rms_norm_eps"], "rope_theta": hcfg["rope_theta"],
           "vocab_size": hcfg["target_vocab_size"], "draft_vocab_size": hcfg["draft_vocab_size"],
           "eagle_aux_hidden_state_layer_ids": hcfg["feature_layers"], "torch_dtype": "float16",
           "target_source": Path(manifest.source).name, "training": meta}
    (out / HEAD_CONFIG).write_text(json.dumps(cfg, indent=2) + "\n")


def load_head(head_dir: Path) -> tuple[dict, dict[str, np.ndarray]]:
    """A head's (config, weights) in our names: ours as saved, published layouts through
    buildlib/heads/formats.read_head."""
    from backend.buildlib.heads.formats import read_head

    return read_head(Path(head_dir))


def _plot(history, validation, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    h = np.asarray(history)
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(15, 4))
    if h.size:
        k = max(1, len(h) // 100)
        smooth = lambda x: np.convolve(x, np.ones(k) / k, mode="valid")
        a.plot(smooth(h[:, 1]), label="total loss")
        a.plot(smooth(h[:, 2]), label="cross-entropy (step 1)")
        b.plot(smooth(h[:, 3]), label="top-1 agreement, step 1")
        b.plot(smooth(h[:, 4]), label="top-1 agreement, step 2 (own features)")
    a.set_xlabel("step")
    a.legend()
    b.set_xlabel("step")
    b.set_title("training batches")
    b.legend()
    if validation:
        tok = [v["tokens"] / 1e6 for v in validation]
        c.plot(tok, [v["acc1"] for v in validation], "o-", label="depth 1")
        c.plot(tok, [v["acc2"] for v in validation], "o-", label="depth 2 (own features)")
    c.set_xlabel("training tokens seen (millions)")
    c.set_title("held-out chat: greedy acceptance")
    c.legend()
    fig.suptitle("EAGLE draft head training")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
