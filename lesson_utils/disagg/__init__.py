"""Lesson 09: disaggregated prefill - a prefill worker and a decode worker exchanging KV blocks."""
