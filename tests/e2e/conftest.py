def pytest_configure(config):
    config.addinivalue_line("markers", "e2e: end-to-end run of a real client (OpenCode) against a live daemon")
