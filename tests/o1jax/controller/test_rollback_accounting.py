"""A rollback (a rejected step, an answer prefix written below the thinking minimum) takes
the removed tokens out of everything a trace reports and a verifier reads: log p,
confidences, windows; and the thinking budget holds at its edges. Checked against a
numpy recomputation of the mock model's distributions over the kept tokens."""

import numpy as np

from o1jax.controller import LoopSettings, ReasoningRequest, get_policy

from tests.o1jax.controller.conftest import ID, MockWorld

TOP_K = 5  # the controller's default DeepConf top-k


def per_token(world: MockWorld, prompt, generated):
  """(log p, confidence) of each generated token: the mock's logits row of the previous
  token (no triggers here), log-softmax in float64, confidence -mean of the top-k."""
  ids = {s: i for i, s in enumerate(world.vocab)}
  table = np.zeros((len(world.vocab),) * 2)
  for a, b, x in world.edges:
    table[ids[a], ids[b]] = x
  seq, lps, confs = list(prompt), [], []
  for t in generated:
    row = table[seq[-1]]
    lp = row - row.max() - np.log(np.exp(row - row.max()).sum())
    lps.append(lp[t])
    confs.append(-np.sort(lp)[::-1][:TOP_K].mean())
    seq.append(t)
  return np.array(lps), np.array(confs)


def test_an_answer_prefix_rolled_back_for_wait_leaves_the_mean_log_p():
  # " A" then the model writes the prefix at 1 thinking token (minimum 3): rolled back,
  # " Wait" forced. Before, the removed prefix's log p stayed in mean_logprob.
  world = MockWorld([("Q", " A", 3), (" A", "The answer is", 3), (" Wait", " B", 3),
                     (" B", "The answer is", 3), ("The answer is", " 7", 5), (" 7", "</s>", 5)])
  ctl = world.controller(max_rows=4)
  (res,) = ctl.run(["Q"], get_policy("budget_forcing", min_thinking_tokens=3,
                                     max_thinking_tokens=20, temperature=0.0))
  t = res.traces[0]
  assert t.tokens.discarded == 1 and t.tokens.waits == 1
  lps, confs = per_token(world, ctl.encode("Q"), t.token_ids)
  np.testing.assert_allclose(t.mean_logprob, lps.mean(), rtol=1e-6)
  np.testing.assert_allclose(t.mean_confidence, confs.mean(), rtol=1e-6)


def test_a_retried_step_is_scored_on_its_own_tokens():
  """group_confidence verifier, threshold 5: the greedy first step ' bad B' scores 3.99
  and is rejected; the retry ' A B' scores 5.17 over its own tokens. Before, the rejected
  attempt's confidences stayed in the window (4.58): with two retries allowed the good
  retry was rejected too."""
  world = MockWorld([("Q", " A", 2.0), ("Q", " bad", 2.2), (" A", " B", 8), (" bad", " B", 1.0),
                     (" B", "\n\n", 8), ("\n\n", " C", 8), (" C", " D", 8), (" D", "\n\n", 8),
                     ("The answer is", " 7", 8), (" 7", "</s>", 8)])
  ctl = world.controller(max_rows=16)
  prompt = ctl.encode("Q")

  def policy(retries):
    return get_policy("think_verify_backtrack", verifier="group_confidence",
                      backtrack_threshold=5.0, max_step_backtracks=retries,
                      max_backtracks=retries, temperature=0.0, temp_bump=1.0, exit_tau=2.0,
                      max_steps=2, step_delimiter="\n\n", max_thinking_tokens=30,
                      max_answer_tokens=2)

  found = 0
  for seed in range(30):
    request = [ReasoningRequest("Q", request_id=seed, seed=seed)]
    one = ctl.run(request, policy(1))[0].traces[0]
    if not (one.text.startswith(" A B\n\n") and one.backtracks == 1):
      continue
    found += 1
    _, confs = per_token(world, prompt, one.token_ids)
    np.testing.assert_allclose(one.steps[1].score, confs[:3].mean(), rtol=1e-5)
    # The same retry (keys per attempt and position) with a second retry allowed: kept.
    two = ctl.run(request, policy(2))[0].traces[0]
    assert [s.action for s in two.steps][:2] == ["backtrack", "continue"]
    assert two.text.startswith(" A B\n\n")
    # Every reported confidence is over the kept tokens.
    _, kept = per_token(world, prompt, two.token_ids)
    windows = [kept[i - 16:i].mean() for i in range(16, len(kept) + 1)]
    np.testing.assert_allclose(two.mean_confidence, kept.mean(), rtol=1e-5)
    np.testing.assert_allclose(two.lowest_group_confidence,
                               min(windows) if windows else kept.mean(), rtol=1e-5)
    break
  assert found


def test_the_window_ending_at_the_last_thinking_token_can_stop_the_trace():
  # Window 2, threshold 3.9: the window ending at thinking token 4 (" C" after " B", then
  # the flat row of " C") is 3.56. Before, at max_thinking_tokens=4 the budget switched the
  # phase to the answer first and that window was never checked: the trace answered.
  world = MockWorld([("Q", " A", 5), (" A", " B", 5), (" B", " C", 5), (" C", " D", 0.0),
                     (" D", " A", 5), ("The answer is", " 7", 5), (" 7", "</s>", 5)])
  request = [ReasoningRequest(prompt="Q", request_id=0)]
  for budget in (4, 5):
    settings = LoopSettings(conf_window=2, max_thinking_tokens=budget, answer_on_eos=True)
    t = world.controller().generate(request, settings, 1, conf_stop=[3.9]).traces[0][0]
    assert t.exit_reason == "low_confidence" and t.answer is None, budget


def test_a_zero_thinking_budget_forces_the_answer_before_any_thinking_token():
  world = MockWorld([("Q", " A", 5), (" A", " B", 5), (" B", " C", 5),
                     ("The answer is", " 7", 5), (" 7", "</s>", 5)])
  ctl = world.controller()
  for budget in (0, 1, 2):
    (res,) = ctl.run(["Q"], get_policy("greedy_cot", max_thinking_tokens=budget))
    t = res.traces[0]
    assert t.tokens.thinking == budget, (budget, t.text)
    assert t.answer == "7"
  assert ID[" A"] not in ctl.run(["Q"], get_policy("greedy_cot", max_thinking_tokens=0))[0] \
      .traces[0].token_ids
