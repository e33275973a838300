"""bucketing"""
