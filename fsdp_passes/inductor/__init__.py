"""inductor"""
