"""Where keyed records outlive one process: the fingerprint journal (files) and the shared
index of replicas (Redis). Neither holds anyone's text.
"""
