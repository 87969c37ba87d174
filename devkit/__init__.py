"""Development kit: local broker processes and throwaway Airflow environments.

Used by the tests, the benchmarks and the demo. Not part of the installed provider.
"""
