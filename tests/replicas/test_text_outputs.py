"""The output side (`TextOutputs`) built directly on real requests and their snapshots: text made
from the token outputs, stop strings found there, the outputs a stop drops and the final one cut
exactly where the detokenizer cuts it. The byte-level tokenizer makes one token per character."""

from __future__ import annotations

from antumbra.replicas.detokenizer import IncrementalDetokenizer
from antumbra.replicas.progress import append_token, cut_at_stop, snapshot
from antumbra.replicas.request import Request, RequestOutput, RequestStatus
from antumbra.replicas.sampling_params import SamplingParams
from antumbra.replicas.text_outputs import TextOutputs
from tests.replicas.test_detokenizer import EOS_ID, PROMPT, TOK


def _request(params: SamplingParams, detokenize: bool = True) -> Request:
    detok = IncrementalDetokenizer(TOK, PROMPT, params) if detokenize else None
    return Request("r", list(PROMPT), params, 0, detok, max_total_tokens=10**6)


def _draw(request: Request, token: int) -> RequestOutput:
    """What the engine reports after drawing `token` (the stepping side: no text)."""
    reason = append_token(request, token, None, (EOS_ID,))
    if reason is not None:
        request.status, request.finish_reason = RequestStatus.FINISHED, reason
    return snapshot(request)


def test_a_stop_string_cuts_the_request_at_the_token_that_completed_it():
    params = SamplingParams(max_tokens=64, stop=["lo w"])
    request, texts = _request(params), TextOutputs((EOS_ID,))
    texts.register(request)
    streamed, stop_at = "", None
    for i, token in enumerate(TOK.encode("hello world").ids):
        out = _draw(request, token)
        assert out.text == "" and not out.finished  # the engine itself never sees the stop string
        processed = texts.process(out)
        if i < 6:
            assert processed.stop_at is None and processed.output is not None
            assert processed.output.token_ids == out.token_ids
            assert processed.output.text == "hello world"[: i + 1]
            streamed += processed.output.new_text
        elif i == 6:  # "w" completes "lo w": the request ends after 7 tokens, its text before the stop
            assert processed.stop_at == 7 and processed.output is not None
            assert processed.output.token_ids == out.token_ids[:7] and processed.output.text == "hel"
            assert not processed.output.finished
            streamed += processed.output.new_text
            stop_at = processed.stop_at
        else:  # drawn before the engine learnt of the stop: never reported
            assert processed == (None, None)
    assert streamed == "hel" and stop_at == 7
    # The engine cuts the request there and finishes it; its final snapshot is reported cut.
    cut_at_stop(request, stop_at)
    request.status, request.finish_reason = RequestStatus.FINISHED, "stop"
    final = texts.process(snapshot(request))
    assert final.stop_at is None and final.output is not None
    assert final.output.finished and final.output.finish_reason == "stop"
    assert final.output.token_ids == TOK.encode("hello w").ids and final.output.text == "hel"
    assert final.output.new_token_ids == [] and final.output.new_text == ""


def test_a_finished_output_releases_held_back_text_and_an_eos_adds_none():
    params = SamplingParams(max_tokens=64, stop=["xyz"])
    request, texts = _request(params), TextOutputs((EOS_ID,))
    texts.register(request)
    pieces = []
    for token in [*TOK.encode("abx").ids, EOS_ID]:
        processed = texts.process(_draw(request, token))
        assert processed.stop_at is None and processed.output is not None
        pieces.append(processed.output.new_text)
    assert pieces == ["a", "b", "", "x"]  # "x" may begin "xyz": held back until the end
    assert processed.output.text == "abx" and processed.output.finish_reason == "stop"
    assert processed.output.token_ids[-1] == EOS_ID


def test_a_stop_string_in_a_finished_output_finishes_it_there():
    params = SamplingParams(max_tokens=3, stop=["b"])
    request, texts = _request(params), TextOutputs((EOS_ID,))
    texts.register(request)
    outs = [texts.process(_draw(request, t)) for t in TOK.encode("abc").ids[:2]]
    assert outs[1].stop_at == 2 and outs[1].output is not None and outs[1].output.text == "a"
    # The engine ends it by length a token later, before the stop is applied: reported as the stop.
    last = texts.process(_draw(request, TOK.encode("c").ids[0]))
    assert last.output is not None and last.output.finish_reason == "stop"
    assert last.output.token_ids == TOK.encode("ab").ids and last.output.text == "a"


def test_requests_without_a_detokenizer_pass_through():
    request, texts = _request(SamplingParams(max_tokens=2), detokenize=False), TextOutputs((EOS_ID,))
    texts.register(request)
    out = _draw(request, 70)
    assert texts.process(out) == (out, None)
