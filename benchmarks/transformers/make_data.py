#!/usr/bin/env python3
"""Make realistic, labelled input arrays for the transformer models that get_models.py wrote.

    python make_data.py MODELS_DIR DATA_DIR [--calib CALIB_DIR] [--only a,b] [--seed 0]

For each model this writes DATA_DIR/<name>.npz holding
  * one array per model input, named like the input, with a leading *sample* axis:
    arr[i] is exactly the tensor to feed for sample i, batch axis included
    (e.g. gector_distilbert `input_ids` is [N, 1, 64] int64);
  * "__meta__": a JSON string {model, inputs, n, shapes, dtypes, labels, label_kind, ...}
and, with --calib, CALIB_DIR/<name>.npz = the even-indexed samples, without __meta__.
Output is deterministic for a given --seed (and the same espeak-ng build).

Everything comes from installed packages or the OS (no downloads):
  images     scikit-image's bundled sample photos and textures (skimage/data/*.png|jpg)
  text       CPython's pydoc_data.topics (the language reference), split into sentences
  speech     Debian's espeak-ng (whisper_* are skipped without it)
  tokenizers the tokenizer.json files that ship with the model packages (get_models.py
             copies them next to the models)

Labels are known by construction:
  vit_s_focus        one photo pasted at a random place onto a textured background:
                     its box is the region of interest
  gector_distilbert  real sentences, 3/4 of them with one injected error of a known kind
                     (duplicated function word, a/an, their/there, its/it's,
                     than/then, has/have, are/is, to/too): the word and the edit tag
                     GECToR should predict there
  whisper_tiny_en_*  espeak-ng speech of real sentences in 3 English voices: the text
"""
import argparse
import importlib.util
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from PIL import Image, ImageFilter

# ------------------------------------------------------------------------------- helpers

_SENTS = None


def sentences():
    """Real English sentences from CPython's pydoc_data.topics (as the zoo's make_data.py)."""
    global _SENTS
    if _SENTS is None:
        from pydoc_data.topics import topics
        txt = re.sub(r"\s+", " ", " ".join(topics[k] for k in sorted(topics)))
        ok = []
        for s in re.split(r"(?<=[.!?])\s+(?=[A-Z])", txt):
            s = s.strip()
            if 30 <= len(s) <= 160 and re.fullmatch(r"[A-Za-z0-9 ,.;:'()\-?!]+", s) and s.count(" ") >= 4:
                ok.append(s)
        _SENTS = sorted(set(ok))
    return _SENTS


def meta_array(d):
    return np.array(json.dumps(d, ensure_ascii=False))


def skimage_dir():
    spec = importlib.util.find_spec("skimage")
    return Path(list(spec.submodule_search_locations)[0]) / "data"


def save(data_dir, calib_dir, name, arrs, meta):
    n = len(next(iter(arrs.values())))
    meta = dict(model=name, inputs=list(arrs), n=n,
                shapes={k: list(v.shape[1:]) for k, v in arrs.items()},
                dtypes={k: v.dtype.name for k, v in arrs.items()}, **meta)
    np.savez(Path(data_dir) / f"{name}.npz", **arrs, __meta__=meta_array(meta))
    if calib_dir:
        np.savez(Path(calib_dir) / f"{name}.npz", **{k: v[::2] for k, v in arrs.items()})
    print(f"{name}: {n} samples, " + ", ".join(f"{k} {v.dtype.name}{list(v.shape)}" for k, v in arrs.items()))


# ------------------------------------------------------------------------------- vit_s_focus

VIT_MEAN = np.array([0.485, 0.456, 0.406], np.float32)
VIT_STD = np.array([0.229, 0.224, 0.225], np.float32)
OBJECTS = ["chelsea.png", "astronaut.png", "coffee.png", "rocket.jpg", "camera.png",
           "motorcycle_left.png", "retina.jpg", "ihc.png"]
TEXTURES = ["grass.png", "brick.png", "gravel.png"]


def gen_vit_s_focus(models_dir, rng, n=48, size=224):
    """A photo (scikit-image sample) pasted onto a textured or blurred background; the label
    is its box. Input: ImageNet mean/std normalised RGB, 224x224, NCHW."""
    d = skimage_dir()
    objs = {o: Image.open(d / o).convert("RGB") for o in OBJECTS if (d / o).exists()}
    tex = {t: Image.open(d / t).convert("L") for t in TEXTURES if (d / t).exists()}
    blur_src = [o for o in ("hubble_deep_field.jpg", "coins.png", "moon.png", "page.png") if (d / o).exists()]
    xs, labels, notes = [], [], []
    for i in range(n):
        kind = i % 4
        if kind < 3 and tex:                      # a grey texture, tinted, lowered contrast
            tname = sorted(tex)[i % len(tex)]
            t = tex[tname]
            cx, cy = rng.integers(0, t.width - 300), rng.integers(0, t.height - 300)
            g = np.asarray(t.crop((cx, cy, cx + 300, cy + 300)).resize((size, size)), np.float32) / 255
            tint = rng.uniform(0.35, 0.9, 3)
            bg = (0.5 + 0.5 * (g[..., None] - g.mean())) * tint * 255
            bgname = f"texture:{tname}"
        else:                                     # a heavily blurred photo
            bname = blur_src[i % len(blur_src)]
            b = Image.open(d / bname).convert("RGB").resize((size, size)).filter(ImageFilter.GaussianBlur(10))
            bg = np.asarray(b, np.float32) * rng.uniform(0.6, 1.0)
            bgname = f"blurred:{bname}"
        bg = Image.fromarray(np.clip(bg, 0, 255).astype(np.uint8))
        oname = sorted(objs)[i % len(objs)]
        o = objs[oname]
        w = int(rng.integers(int(0.25 * size), int(0.45 * size)))
        h = max(16, int(round(w * o.height / o.width)))
        if h > 0.6 * size:
            h = int(0.6 * size)
            w = int(round(h * o.width / o.height))
        x0, y0 = int(rng.integers(0, size - w)), int(rng.integers(0, size - h))
        bg.paste(o.resize((w, h), Image.LANCZOS), (x0, y0))
        a = (np.asarray(bg, np.float32) / 255 - VIT_MEAN) / VIT_STD
        xs.append(a.transpose(2, 0, 1)[None])
        labels.append([x0, y0, x0 + w, y0 + h])
        notes.append(f"{oname} on {bgname}")
    return {"input_image": np.stack(xs).astype(np.float32)}, dict(
        labels=labels, label_kind="box [x0, y0, x1, y1] (pixels of the 224x224 input) of the pasted photo",
        sources=notes, preprocess="224x224 RGB, (x/255 - ImageNet mean) / ImageNet std, NCHW",
        decode="output_importance [1,1,224,224] is a sigmoid heatmap; region = heatmap > 0.5")


# ------------------------------------------------------------------------------- gector

def _corrupt(words, rng, kind):
    """Inject one error of `kind` into a word list. Returns (new_words, error word indices
    (any of them counts), expected GECToR tag) or None if the sentence has no place for it."""
    low = [w.lower() for w in words]
    vowel = re.compile(r"^[aeiouAEIOU]")
    if kind == "duplicate":             # a repeated function word ("the the")
        c = [i for i, w in enumerate(low) if w in FUNCTION_WORDS]
        if not c:
            return None
        j = int(rng.choice(c))
        return words[:j + 1] + [words[j]] + words[j + 1:], [j, j + 1], "$DELETE"
    if kind == "a_an":
        c = [i for i in range(len(words) - 1) if low[i] == "a" and vowel.match(words[i + 1]) is None
             and words[i + 1].isalpha()]
        c2 = [i for i in range(len(words) - 1) if low[i] == "an" and vowel.match(words[i + 1])]
        if c and (not c2 or rng.random() < 0.5):
            j = int(rng.choice(c))
            return words[:j] + [words[j] + "n"] + words[j + 1:], [j], "$REPLACE_a"
        if c2:
            j = int(rng.choice(c2))
            return words[:j] + [words[j][0]] + words[j + 1:], [j], "$REPLACE_an"
        return None
    pairs = {"their_there": ("their", "there", "$REPLACE_their"),
             "its_its": ("its", "it's", "$REPLACE_its"),
             "than_then": ("than", "then", "$REPLACE_than"),
             "has_have": ("has", "have", "$REPLACE_has"),
             "are_is": ("are", "is", "$REPLACE_are"),
             "to_too": ("to", "too", "$REPLACE_to")}
    src, bad, tag = pairs[kind]
    c = [i for i, w in enumerate(words) if w == src]
    if not c:
        return None
    j = int(rng.choice(c))
    return words[:j] + [bad] + words[j + 1:], [j], tag


FUNCTION_WORDS = {"the", "a", "an", "of", "to", "in", "is", "for", "and", "that", "it", "be", "as",
                  "on", "by", "with", "this", "are", "or"}
GEC_KINDS = ["duplicate", "a_an", "its_its", "has_have", "are_is", "than_then",
             "to_too", "their_there"]


def gen_gector_distilbert(models_dir, rng, n=64, seq=64):
    """Clean sentences (every 4th sample) and sentences with one injected error."""
    from tokenizers import Tokenizer

    from quire_grammar.edits import tokenize_spans
    tok = Tokenizer.from_file(str(Path(models_dir) / "gector_distilbert.tokenizer.json"))
    tags = json.loads((Path(models_dir) / "gector_distilbert.tag_vocab.json").read_text())["tags"]
    pool = [s for s in sentences() if len(s) <= 140]
    order = rng.permutation(len(pool))
    ids_l, am_l, labels, texts, firsts = [], [], [], [], []
    used = set()
    k = 0
    for i in range(n):
        found = None
        for attempt in range(1 if i % 4 == 0 else len(GEC_KINDS)):
            kind = "clean" if i % 4 == 0 else GEC_KINDS[(k + attempt) % len(GEC_KINDS)]
            for j in order:
                if j in used:
                    continue
                words = [w for w, _, _ in tokenize_spans(pool[j])]
                r = (words, [], None) if kind == "clean" else _corrupt(words, rng, kind)
                if r is None:
                    continue
                enc = tok.encode(r[0], is_pretokenized=True)
                if len(enc.ids) <= seq:
                    found = (j, kind, r, enc)
                    break
            if found:
                break
        if found is None:
            raise RuntimeError("ran out of sentences")
        j, kind, (nw, err, tag), enc = found
        used.add(j)
        if kind != "clean":
            k += attempt + 1
            assert tag in tags, tag
        first = {}
        for p, wid in enumerate(enc.word_ids):
            if wid is not None and wid not in first:
                first[wid] = p
        pad = seq - len(enc.ids)
        ids_l.append(list(enc.ids) + [0] * pad)
        am_l.append([1] * len(enc.ids) + [0] * pad)
        labels.append({"kind": kind, "error_words": err, "tag": tag})
        texts.append(" ".join(nw))
        firsts.append([first.get(w) for w in range(len(nw))])
    ids = np.array(ids_l, np.int64)[:, None]
    am = np.array(am_l, np.int64)[:, None]
    return {"input_ids": ids, "attention_mask": am}, dict(
        labels=labels, texts=texts, word_first_token=firsts, tags=tags,
        label_kind="per sample: kind of injected error ('clean' = none), indices of the words that "
                   "carry it (any counts) and the GECToR tag expected there; the tag of word w is the "
                   "argmax of logits at token word_first_token[w]",
        sources=["pydoc_data.topics"] * n,
        preprocess=f"words = quire_grammar.edits.tokenize_spans, the package's tokenizer.json with "
                   f"is_pretokenized=True ([CLS] ... [SEP]), padded with [PAD]=0 to {seq}")


# ------------------------------------------------------------------------------- whisper

VOICES = ["en-us", "en-gb", "en-gb-x-rp"]
SOT, NOTS, EOT = 50257, 50362, 50256


def speak(text, voice, speed, rng):
    from scipy.io import wavfile
    from scipy.signal import resample_poly
    with tempfile.TemporaryDirectory() as t:
        p = Path(t) / "s.wav"
        subprocess.run(["espeak-ng", "-v", voice, "-s", str(speed), "-w", str(p), text], check=True,
                       capture_output=True)
        sr, a = wavfile.read(p)
    a = a.astype(np.float32) / 32768.0
    if a.ndim > 1:
        a = a.mean(1)
    a = resample_poly(a, 16000, sr).astype(np.float32)
    a = np.concatenate([np.zeros(int(rng.uniform(0.2, 0.8) * 16000), np.float32), a,
                        np.zeros(int(0.5 * 16000), np.float32)])
    a = a / (np.abs(a).max() + 1e-9) * rng.uniform(0.3, 0.8)
    rms = np.sqrt(np.mean(a ** 2))
    a = a + rng.normal(0, rms * 10 ** (-rng.uniform(25, 40) / 20), a.shape).astype(np.float32)
    return a


def gen_whisper(models_dir, rng, n=32, tokens=64):
    """espeak-ng speech of real sentences -> log-mel features (encoder data); the float
    encoder's output plus the reference transcript, teacher-forced (decoder data)."""
    import onnxruntime as ort
    from tokenizers import Tokenizer
    from transformers import WhisperFeatureExtractor
    if shutil.which("espeak-ng") is None:
        print("whisper_tiny_en_*: espeak-ng not installed (apt-get install espeak-ng), skipped")
        return None
    tok = Tokenizer.from_file(str(Path(models_dir) / "whisper_tiny_en.tokenizer.json"))
    fe = WhisperFeatureExtractor(feature_size=80, sampling_rate=16000)
    pool = [s for s in sentences() if re.fullmatch(r"[A-Za-z ,.]+", s) and 40 <= len(s) <= 120]
    pick = [pool[j] for j in rng.permutation(len(pool))[:n]]
    feats, ids, lens, meta_v = [], [], [], []
    for i, text in enumerate(pick):
        voice, speed = VOICES[i % len(VOICES)], int(rng.integers(130, 165))
        a = speak(text, voice, speed, rng)
        assert len(a) <= 30 * 16000, "longer than Whisper's 30 s window"
        feats.append(fe(a, sampling_rate=16000, return_tensors="np").input_features.astype(np.float32))
        t = [SOT, NOTS] + tok.encode(" " + text, add_special_tokens=False).ids + [EOT]
        assert len(t) <= tokens
        lens.append(len(t))
        ids.append(t + [EOT] * (tokens - len(t)))
        meta_v.append(f"espeak-ng -v {voice} -s {speed}, {len(a) / 16000:.1f} s")
    feats = np.stack(feats)                                   # [N, 1, 80, 3000]
    enc = ort.InferenceSession(str(Path(models_dir) / "whisper_tiny_en_encoder.onnx"),
                               providers=["CPUExecutionProvider"])
    hs = np.stack([enc.run(None, {"input_features": f})[0] for f in feats])   # [N, 1, 1500, 384]
    common = dict(texts=pick, sources=meta_v, token_lengths=lens,
                  special_tokens={"startoftranscript": SOT, "notimestamps": NOTS, "endoftext": EOT})
    enc_meta = dict(labels=pick, label_kind="reference transcript (scored by greedy decoding with the "
                    "decoder model: word error rate)", preprocess="16 kHz mono, transformers "
                    "WhisperFeatureExtractor (80 log-mel bins, 30 s = 3000 frames)", **common)
    dec_meta = dict(labels=[t[:n_] for t, n_ in zip(ids, lens)],
                    label_kind="reference token ids [startoftranscript, notimestamps, text..., endoftext]; "
                    "input_ids is this sequence padded with endoftext to a fixed length (teacher forcing): "
                    "logits[p] should predict input_ids[p+1] for 1 <= p < length-1",
                    preprocess="encoder_hidden_states = float whisper_tiny_en_encoder output for the "
                    "same sample", **common)
    return ({"input_features": feats}, enc_meta), ({"input_ids": np.array(ids, np.int64)[:, None],
                                                     "encoder_hidden_states": hs.astype(np.float32)}, dec_meta)


# ------------------------------------------------------------------------------- main

def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models_dir")
    ap.add_argument("data_dir")
    ap.add_argument("--calib", help="also write the even-indexed samples (no __meta__) here")
    ap.add_argument("--only", default="")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    Path(a.data_dir).mkdir(parents=True, exist_ok=True)
    if a.calib:
        Path(a.calib).mkdir(parents=True, exist_ok=True)
    only = {s for s in a.only.split(",") if s}
    want = lambda k: not only or k in only  # noqa: E731
    seeds = {"vit_s_focus": 1, "gector_distilbert": 2, "whisper": 3}
    rng = lambda k: np.random.default_rng([a.seed, seeds[k]])  # noqa: E731
    if want("vit_s_focus"):
        save(a.data_dir, a.calib, "vit_s_focus", *gen_vit_s_focus(a.models_dir, rng("vit_s_focus")))
    if want("gector_distilbert"):
        save(a.data_dir, a.calib, "gector_distilbert", *gen_gector_distilbert(a.models_dir, rng("gector_distilbert")))
    if want("whisper_tiny_en_encoder") or want("whisper_tiny_en_decoder"):
        r = gen_whisper(a.models_dir, rng("whisper"))
        if r is not None:
            save(a.data_dir, a.calib, "whisper_tiny_en_encoder", *r[0])
            save(a.data_dir, a.calib, "whisper_tiny_en_decoder", *r[1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
