"""Evidence that the control works: the engine audit against public advisories, the
isolation probe, and the sealed evidence records both write.
"""
