"""MiDashengLM chat requests: audio in `input_audio` and `audio_url` parts, equal to the same
request given to ``process`` as the text transformers renders from the template."""

from __future__ import annotations

import base64

import mmproc
import numpy as np
import pytest
import torch
from mmproc.testing.samples import encode_audio, tone
from mmproc_midashenglm.demo import write_demo_folder


@pytest.fixture(scope="module")
def processor(tmp_path_factory: pytest.TempPathFactory) -> mmproc.Processor:
    folder = write_demo_folder(tmp_path_factory.mktemp("midashenglm") / "demo")
    with mmproc.get_processor(folder) as processor:
        yield processor


def test_a_chat_with_audio_parts_is_the_rendered_request(processor: mmproc.Processor) -> None:
    wav = encode_audio(tone(1.5, 44100, channels=2), 44100, "wav")
    flac = encode_audio(tone(0.7, 16000), 16000, "flac")
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Transcribe:"},
                {
                    "type": "input_audio",
                    "input_audio": {"data": base64.b64encode(wav).decode(), "format": "wav"},
                },
            ],
        },
        {"role": "assistant", "content": "Done."},
        {
            "role": "user",
            "content": [
                {
                    "type": "audio_url",
                    "audio_url": {
                        "url": "data:audio/flac;base64," + base64.b64encode(flac).decode()
                    },
                }
            ],
        },
    ]
    chat = processor.process_chat(messages)
    as_hf = [
        {
            **m,
            "content": m["content"]
            if isinstance(m["content"], str)
            else [p if p["type"] == "text" else {"type": "audio"} for p in m["content"]],
        }
        for m in messages
    ]
    hf = processor.hf_processor
    text = hf.tokenizer.apply_chat_template(
        as_hf, chat_template=hf.chat_template, tokenize=False, add_generation_prompt=True
    )
    plain = processor.process(text, {"audio": [wav, flac]})
    assert chat.prompt_token_ids == plain.prompt_token_ids
    assert [f.placeholder for f in chat.features] == [f.placeholder for f in plain.features]
    for ours, theirs in zip(chat.features, plain.features):
        assert torch.equal(ours.data["input_values"], theirs.data["input_values"])
    assert len(chat.features) == 2 and np.diff([f.placeholder.offset for f in chat.features]) > 0
