"""A package, so its test files may share a name with a file in another folder
(test_batching.py, test_cache.py, test_quantize.py): pytest imports them as engine.test_<part>."""
