from loomax.rl.rewards.exact_match import exact_match


def test_exact_match_ignores_surrounding_space_only():
    assert exact_match("p", "  a d h\n", " a d h") == 1.0
    assert exact_match("p", " a dh", " a d h") == 0.0
    assert exact_match("p", "a", None) == 0.0
