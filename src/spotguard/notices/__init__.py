"""notices"""
