"""The stateless front of pagedserve: public API, admission, balancing, detokenization."""
