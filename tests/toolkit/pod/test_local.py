"""The local pod's output filter (the processes themselves are tested in test_multiprocess)."""

from toolkit.pod import local as pod

GLOO = "[Gloo] Rank 1 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1"


def forwarded(lines: list[str]) -> list[str]:
  kept, after_gloo = [], False
  for line in lines:
    after_gloo = pod.is_gloo_noise(line, after_gloo)
    if not after_gloo:
      kept.append(line)
  return kept


def test_gloo_lines_and_their_interleaved_pieces_are_dropped():
  # Two Gloo threads writing at once: both messages on one line, the second newline alone,
  # or one thread's rank number split off onto a line of its own.
  assert forwarded(["process 1 of 2", GLOO + GLOO, "", "step 1"]) == ["process 1 of 2", "step 1"]
  assert forwarded([GLOO[:-1] + GLOO[:-1], "1", "1", "sample:"]) == ["sample:"]
  assert forwarded(["[Gloo] Rank 0 is connected to ", "1 peer ranks. ", "x"]) == ["x"]


def test_blank_and_numeric_lines_of_the_program_itself_are_kept():
  assert forwarded(["sample:", "", "12", "The end"]) == ["sample:", "", "12", "The end"]
