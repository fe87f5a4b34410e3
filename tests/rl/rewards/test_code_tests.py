import loomax.rl.rewards.code_tests as code


def test_code_tests_scores_passing_tests_and_stops_a_hanging_program(monkeypatch):
    program = "def add(a, b):\n    return a + b"
    tests = "assert add(1, 2) == 3\nassert add(2, 2) == 5"
    assert code.code_tests("p", program, tests) == 0.5
    monkeypatch.setattr(code, "TIME_LIMIT_S", 0.5)
    assert code.run_test("while True:\n    pass", "", time_limit=0.5) is False
    assert code.code_tests("p", "raise SystemExit(1)", "assert True") == 0.0
