"""modeling"""
