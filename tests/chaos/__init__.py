"""Chaos tests: real ``wowd run`` replicas on one SQLite file under kills, pauses and restarts."""
