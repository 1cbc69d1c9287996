#!/usr/bin/env python3
"""Score the transformer models on the make_data.py arrays, and compare float against another
(e.g. quantized) set of the same models.

    python evaluate.py MODELS_DIR DATA_DIR [--only a,b] [--compare QDIR] [--json out.json]

Without options: runs every float model of MODELS_DIR/manifest.json on DATA_DIR/<name>.npz,
decodes the outputs into task results, scores them against the labels and times float
latency (median of 20 runs of sample 0, onnxruntime CPU).

  --compare QDIR   QDIR/<name>.onnx (same file names as MODELS_DIR) runs on the same samples;
                   reports its task metric, its agreement with the float predictions, and for
                   every output: cosine and SQNR over all samples
                   (SQNR dB = 10*log10(sum(ref^2) / sum((ref - other)^2))) and the mean
                   per-sample cosine. Whisper is also scored as a pipeline: the other encoder
                   with the float decoder, the float encoder with the other decoder, and both
                   others together (when QDIR has both).
  --json FILE      write the full results as JSON

Task metrics
  vit_s_focus              heatmap > 0.5 against the pasted photo's box: mean IoU, share of
                           samples with IoU >= 0.5, share whose heatmap peak is inside the box
  gector_distilbert        at the injected error: exact expected tag / any edit tag; share of
                           clean sentences where some word gets an edit tag (argmax)
  whisper_tiny_en_encoder  word error rate of greedy decoding (with the float decoder)
  whisper_tiny_en_decoder  teacher-forced next-token accuracy on the reference transcript, and
                           WER of greedy decoding (with the float encoder's states)
"""
import argparse
import json
import re
import sys
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

ort.set_default_logger_severity(3)

SOT, NOTS, EOT, TS_BEGIN = 50257, 50362, 50256, 50363


def load(data_dir, name):
    z = np.load(Path(data_dir) / f"{name}.npz", allow_pickle=False)
    meta = json.loads(str(z["__meta__"]))
    return {k: z[k] for k in meta["inputs"]}, meta


def session(path):
    so = ort.SessionOptions()
    so.log_severity_level = 3
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def run_all(sess, arrs, n):
    names = [i.name for i in sess.get_inputs()]
    return [sess.run(None, {k: np.asarray(arrs[k][i]) for k in names}) for i in range(n)]


def latency(sess, arrs, reps=20):
    """Median ms of `reps` runs on the first sample, after 3 warm-up runs."""
    names = [i.name for i in sess.get_inputs()]
    feed = {k: np.asarray(arrs[k][0]) for k in names}
    for _ in range(3):
        sess.run(None, feed)
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        sess.run(None, feed)
        ts.append(time.perf_counter() - t)
    return float(np.median(ts) * 1000)


# ----------------------------------------------------------------------------- whisper helpers

class Whisper:
    """Greedy decoding with an encoder/decoder session pair (no KV cache: the decoder
    re-runs the whole prefix at each step)."""

    def __init__(self, models_dir, data_dir):
        from tokenizers import Tokenizer
        self.tok = Tokenizer.from_file(str(Path(models_dir) / "whisper_tiny_en.tokenizer.json"))
        cfg = json.loads((Path(models_dir) / "whisper_tiny_en.config.json").read_text())
        self.suppress = np.array(cfg.get("suppress_ids", []), int)
        self.suppress_begin = np.array(cfg.get("suppress_ids_begin", []), int)
        self.feats, self.meta = load(data_dir, "whisper_tiny_en_encoder")
        dec, _ = load(data_dir, "whisper_tiny_en_decoder")
        self.float_hs = list(dec["encoder_hidden_states"])   # the float encoder's output
        self.other_hs = None
        self.cache = {}

    def encode(self, enc_sess):
        return [enc_sess.run(None, {"input_features": f})[0] for f in self.feats["input_features"]]

    def _mask(self, lg, first):
        lg = lg.astype(np.float64)
        lg[..., self.suppress] = -np.inf
        lg[..., SOT:] = -np.inf                      # no special or timestamp tokens
        if first:
            lg[..., self.suppress_begin] = -np.inf
        return lg

    def greedy(self, dec_sess, hs, max_new=40):
        """Greedy decoding, all unfinished samples in one batch per step; falls back to one
        sample at a time if the decoder does not take a batch. At most `max_new` tokens (the
        longest reference has 26)."""
        seqs = [[SOT, NOTS] for _ in hs]
        try:
            h = np.concatenate(hs)
            active = np.arange(len(hs))
            for step in range(max_new):
                ids = np.array([seqs[i] for i in active], np.int64)
                lg = dec_sess.run(None, {"input_ids": ids, "encoder_hidden_states": h[active]})[0][:, -1]
                nxt = np.argmax(self._mask(lg, step == 0), -1)
                for i, t in zip(active, nxt):
                    seqs[i].append(int(t))
                active = active[nxt != EOT]
                if not len(active):
                    break
        except Exception:
            seqs = []
            for h in hs:
                ids = [SOT, NOTS]
                for step in range(max_new):
                    lg = dec_sess.run(None, {"input_ids": np.array([ids], np.int64),
                                             "encoder_hidden_states": h})[0][0, -1]
                    nxt = int(np.argmax(self._mask(lg, step == 0)))
                    ids.append(nxt)
                    if nxt == EOT:
                        break
                seqs.append(ids)
        out = []
        for q in seqs:
            q = q[2:]
            out.append(self.tok.decode(q[:q.index(EOT)] if EOT in q else q).strip())
        return out

    def transcribe(self, key, hs, dec_sess):
        """hs: the encoder states of every sample ([1, 1500, 384] each)."""
        if key not in self.cache:
            self.cache[key] = self.greedy(dec_sess, hs)
        return self.cache[key]


def words(s):
    return re.sub(r"[^a-z0-9' ]+", " ", s.lower()).split()


def wer(refs, hyps):
    """Word error rate over the whole set (edit distance / reference words)."""
    err = tot = 0
    for r, h in zip(refs, hyps):
        r, h = words(r), words(h)
        d = list(range(len(h) + 1))
        for i in range(1, len(r) + 1):
            prev, d[0] = d[0], i
            for j in range(1, len(h) + 1):
                cur = min(d[j] + 1, d[j - 1] + 1, prev + (r[i - 1] != h[j - 1]))
                prev, d[j] = d[j], cur
        err += d[len(h)]
        tot += len(r)
    return err / max(1, tot)


# ----------------------------------------------------------------------------- decoders
# Each turns the raw outputs of all samples into a list of per-sample predictions.

def dec_heatmap(outs, meta):
    return [o[0][0, 0] for o in outs]


def dec_gector(outs, meta):
    """Per word: (tag index, probability), read at the word's first sub-token."""
    res = []
    for o, first in zip(outs, meta["word_first_token"]):
        lg = o[0][0].astype(np.float64)
        p = np.exp(lg - lg.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        res.append([(int(np.argmax(p[t])), float(p[t].max())) for t in first])
    return res


def dec_logits_argmax(outs, meta):
    return [np.argmax(o[0][0], -1) for o in outs]


def dec_hidden(outs, meta):
    return [o[0][0] for o in outs]


DECODERS = {"vit_s_focus": dec_heatmap, "gector_distilbert": dec_gector,
            "whisper_tiny_en_encoder": dec_hidden, "whisper_tiny_en_decoder": dec_logits_argmax}


# ----------------------------------------------------------------------------- task metrics

def box_iou(mask, box):
    bm = np.zeros_like(mask, bool)
    x0, y0, x1, y1 = box
    bm[y0:y1, x0:x1] = True
    u = (mask | bm).sum()
    return float((mask & bm).sum() / u) if u else 0.0


def task_metric(name, preds, meta, ctx):
    L = meta["labels"]
    if name == "vit_s_focus":
        ious = [box_iou(p > 0.5, b) for p, b in zip(preds, L)]
        peak = []
        for p, (x0, y0, x1, y1) in zip(preds, L):
            yy, xx = np.unravel_index(np.argmax(p), p.shape)
            peak.append(x0 <= xx < x1 and y0 <= yy < y1)
        return {"mean_iou": float(np.mean(ious)), "iou>=0.5": float(np.mean([i >= 0.5 for i in ious])),
                "peak_in_box": float(np.mean(peak))}
    if name == "gector_distilbert":
        keep = meta["tags"].index("$KEEP")
        exact, det, flagged = [], [], []
        for p, lab in zip(preds, L):
            if lab["kind"] == "clean":
                flagged.append(any(t != keep for t, _ in p))
                continue
            want = meta["tags"].index(lab["tag"])
            exact.append(any(p[w][0] == want for w in lab["error_words"]))
            det.append(any(p[w][0] != keep for w in lab["error_words"]))
        return {"error_tag_exact": float(np.mean(exact)), "error_detected": float(np.mean(det)),
                "clean_sentences_flagged": float(np.mean(flagged))}
    if name == "whisper_tiny_en_encoder":
        return {"wer_greedy_with_float_decoder": wer(meta["texts"], ctx["hyps"])}
    if name == "whisper_tiny_en_decoder":
        acc = []
        for p, ref in zip(preds, L):
            acc += [int(p[i]) == ref[i + 1] for i in range(1, len(ref) - 1)]
        return {"next_token_acc_teacher_forced": float(np.mean(acc)),
                "wer_greedy_with_float_encoder": wer(meta["texts"], ctx["hyps"])}
    raise KeyError(name)


def agreement(name, pf, pq, meta):
    """How close the other model's decoded predictions are to the float model's."""
    if name == "vit_s_focus":
        r = []
        for a, b in zip(pf, pq):
            ma, mb = a > 0.5, b > 0.5
            u = (ma | mb).sum()
            r.append((ma & mb).sum() / u if u else 1.0)
        return {"mask_iou_float_vs_other": float(np.mean(r))}
    if name == "gector_distilbert":
        same = [x[0] == y[0] for a, b in zip(pf, pq) for x, y in zip(a, b)]
        return {"same_word_tag": float(np.mean(same))}
    if name == "whisper_tiny_en_decoder":
        same = [bool(np.all(a[:n - 1] == b[:n - 1])) for a, b, n in zip(pf, pq, meta["token_lengths"])]
        tok = np.mean([np.mean(a[:n - 1] == b[:n - 1]) for a, b, n in zip(pf, pq, meta["token_lengths"])])
        return {"same_argmax_token": float(tok), "same_argmax_sequence": float(np.mean(same))}
    return {}


def numeric(of, oq):
    """Cosine and SQNR (dB) of each output over all samples, and the mean per-sample cosine."""
    res = []
    for k in range(len(of[0])):
        a = np.concatenate([o[k].astype(np.float64).ravel() for o in of])
        b = np.concatenate([o[k].astype(np.float64).ravel() for o in oq])
        cos = float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b) + 1e-30))
        sqnr = float(10 * np.log10((a @ a) / (((a - b) ** 2).sum() + 1e-30)))
        per = [float(x.ravel().astype(np.float64) @ y.ravel().astype(np.float64)
                     / (np.linalg.norm(x) * np.linalg.norm(y) + 1e-30)) for x, y in
               ((o[k], p[k]) for o, p in zip(of, oq))]
        res.append({"cos": round(cos, 5), "sqnr_db": round(sqnr, 2), "mean_sample_cos": round(float(np.mean(per)), 5)})
    return res


def pooled_cos(of, oq):
    """Whisper encoder: cosine of the time-averaged encoder state per sample (an utterance
    embedding), averaged over samples."""
    c = []
    for a, b in zip(of, oq):
        x, y = a[0][0].mean(0), b[0][0].mean(0)
        c.append(float(x @ y / (np.linalg.norm(x) * np.linalg.norm(y) + 1e-30)))
    return float(np.mean(c))


# ----------------------------------------------------------------------------- report

def fmt(d):
    return ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in d.items())


def print_summary(report):
    print("\nsummary")
    for name, r in report.items():
        if name == "whisper_tiny_en_pipeline":
            print(f"  {name}: {fmt(r)}")
            continue
        print(f"  {name}  (n={r['n']}, float {r['float_latency_ms']:.2f} ms)")
        print(f"    float  : {fmt(r['float_task'])}")
        if "other_task" in r:
            worst = min(r["outputs_cos_sqnr"], key=lambda x: x["cos"])
            print(f"    other  : {fmt(r['other_task'])}  ({r['other_latency_ms']:.2f} ms)")
            print(f"    agree  : {fmt(r['agreement'])}; lowest output cos {worst['cos']:.4f}, "
                  f"SQNR {worst['sqnr_db']:.1f} dB, mean per-sample cos {worst['mean_sample_cos']:.4f}")
        if "other_error" in r:
            print(f"    other  : ERROR {r['other_error']}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models_dir")
    ap.add_argument("data_dir")
    ap.add_argument("--only", default="", help="comma-separated model names")
    ap.add_argument("--compare", help="folder of other (e.g. quantized) models with the same file names")
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args()
    mdir = Path(a.models_dir)
    man = json.loads((mdir / "manifest.json").read_text())
    only = {s for s in a.only.split(",") if s}
    report = {}
    wh = None
    sess_cache = {}

    def sess(p):
        p = str(p)
        if p not in sess_cache:
            sess_cache[p] = session(p)
        return sess_cache[p]

    fenc, fdec = mdir / "whisper_tiny_en_encoder.onnx", mdir / "whisper_tiny_en_decoder.onnx"
    qdir = Path(a.compare) if a.compare else None
    for m in man:
        name = m["name"]
        if only and name not in only:
            continue
        if not (Path(a.data_dir) / f"{name}.npz").exists():
            print(f"{name}: no data, skipped")
            continue
        arrs, meta = load(a.data_dir, name)
        n = meta["n"]
        fpath = mdir / m["file"]
        dec = DECODERS[name]
        sf = sess(fpath)
        of = run_all(sf, arrs, n)
        pf = dec(of, meta)
        is_wh = name.startswith("whisper_")
        if is_wh and wh is None:
            wh = Whisper(mdir, a.data_dir)
        ctx = {"hyps": wh.transcribe("float", wh.float_hs, sess(fdec))} if is_wh else {}
        r = {"n": n, "float_latency_ms": round(latency(sf, arrs), 2),
             "float_task": task_metric(name, pf, meta, ctx)}
        if is_wh:
            r["float_transcripts"] = ctx["hyps"]
        other = qdir / m["file"] if qdir else None
        if qdir and not other.exists():
            r["other_error"] = f"no {m['file']} in {qdir}"
        elif other is not None:
            try:
                so = sess(other)
                oq = run_all(so, arrs, n)
                pq = dec(oq, meta)
                if name == "whisper_tiny_en_encoder":
                    wh.other_hs = [o[0] for o in oq]
                    ctx = {"hyps": wh.transcribe("other_enc", wh.other_hs, sess(fdec))}
                elif name == "whisper_tiny_en_decoder":
                    ctx = {"hyps": wh.transcribe("other_dec", wh.float_hs, so)}
                r.update(other_latency_ms=round(latency(so, arrs), 2),
                         other_task=task_metric(name, pq, meta, ctx),
                         agreement=agreement(name, pf, pq, meta),
                         outputs_cos_sqnr=numeric(of, oq),
                         other_bytes=other.stat().st_size)
                if name == "whisper_tiny_en_encoder":
                    r["agreement"]["pooled_state_mean_cos"] = pooled_cos(of, oq)
                if is_wh:
                    r["other_transcripts"] = ctx["hyps"]
            except Exception as e:
                r["other_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        report[name] = r
        short = {k: v for k, v in r.items() if not k.endswith("transcripts")}
        print(name, json.dumps(short), flush=True)
    if wh is not None and qdir and (qdir / fenc.name).exists() and (qdir / fdec.name).exists():
        try:
            if wh.other_hs is None:
                wh.other_hs = wh.encode(sess(qdir / fenc.name))
            hyps = wh.transcribe("other_both", wh.other_hs, sess(qdir / fdec.name))
            report["whisper_tiny_en_pipeline"] = {
                "wer_float": wer(wh.meta["texts"], wh.cache["float"]),
                "wer_other_encoder_and_decoder": wer(wh.meta["texts"], hyps),
                "same_transcript_as_float": float(np.mean([x == y for x, y in zip(hyps, wh.cache["float"])]))}
        except Exception as e:
            report["whisper_tiny_en_pipeline"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    print_summary(report)
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
