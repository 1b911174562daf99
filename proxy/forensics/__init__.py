"""Finding leaks after the fact: readers of captured traffic, the replayer that drives it
through the live pipeline, the replay job and its incident report.
"""
