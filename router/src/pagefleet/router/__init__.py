"""The cache-aware router: picks an engine per request by prefix affinity and load."""
