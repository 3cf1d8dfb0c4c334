"""LoRA in the wire codecs: adapter cards of ``/v1/models`` and ``vllm:lora_requests_info``."""

from __future__ import annotations

from kvroute.wire.model_list import adapter_roots, model_cards
from kvroute.wire.prom import parse_vllm_metrics

# As vLLM 0.32 (CPU) answered with --enable-lora --lora-modules ad1=/tmp/ad1 ad2=/tmp/ad2.
MODELS = (b'{"object":"list","data":['
          b'{"id":"tiny","root":"/m/tiny","parent":null,"max_model_len":2048},'
          b'{"id":"ad1","root":"/tmp/ad1","parent":"tiny","max_model_len":null},'
          b'{"id":"ad2","root":"/tmp/ad2","parent":"tiny","max_model_len":null},'
          b'{"id":"odd","root":"","parent":"tiny","max_model_len":null},'
          b'{"id":"other","root":"/tmp/o","parent":"big","max_model_len":null}]}')

# vLLM sets a new label set to the current time at each step and never removes old ones.
METRICS = """\
# HELP vllm:lora_requests_info Running stats on lora requests.
# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""} 1.7961627554124122e+09
vllm:lora_requests_info{max_lora="2",running_lora_adapters="ad1,ad2",waiting_lora_adapters="ad3"} 1.7961627604124122e+09
vllm:lora_requests_info{max_lora="2",running_lora_adapters="ad1",waiting_lora_adapters=""} 1.7961627584124122e+09
vllm:num_requests_running{engine="0",model_name="tiny"} 2.0
"""


def test_adapter_cards_are_those_whose_parent_is_the_model() -> None:
    assert adapter_roots(model_cards(MODELS), "tiny") == {"ad1": "/tmp/ad1", "ad2": "/tmp/ad2"}
    assert adapter_roots(model_cards(MODELS), "nope") == {}


def test_the_newest_lora_label_set_wins() -> None:
    parsed = parse_vllm_metrics(METRICS, "tiny")
    assert parsed.lora_max == 2
    assert parsed.lora_running == ("ad1", "ad2")
    assert parsed.lora_waiting == ("ad3",)


def test_no_lora_series_means_no_lora() -> None:
    parsed = parse_vllm_metrics('vllm:num_requests_running{model_name="tiny"} 1.0\n', "tiny")
    assert parsed.lora_max is None and parsed.lora_running == ()
