"""Helpers shared by the test suite (no tests here): crash file layers, checkers, CLI runners."""
