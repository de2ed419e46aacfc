"""Lesson 09 (in progress): disaggregated prefill - a prefill worker and a decode worker exchanging KV blocks."""
