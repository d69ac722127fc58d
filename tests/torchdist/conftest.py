"""Scripts run on several processes by ``tests/test_torch_distributed.py`` (under torchrun or
torch.multiprocessing.spawn); plain pytest never collects them."""

collect_ignore_glob = ["*.py"]
