from loomax.rl.rewards.numeric import last_number, numeric


def test_numeric_compares_the_last_number_exactly():
    assert numeric("p", "so the sum is 1,234.", "1234") == 1.0
    assert numeric("p", "half: 2/4", "0.5") == 1.0
    assert numeric("p", "it is -3 or 4", "-3") == 0.0  # the last number counts
    assert numeric("p", "no number", "3") == 0.0
    assert last_number("x 1/0") is None
