"""A package, so its test files may share a name with a file in another folder
(test_lora.py, test_sharding.py): pytest imports them as planner.test_<module>."""
