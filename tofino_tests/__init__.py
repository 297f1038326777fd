"""Tests that compile the TNA program with p4c's Tofino backend (bf-p4c); they skip without it."""
