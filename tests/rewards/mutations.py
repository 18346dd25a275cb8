"""What the differential tests (test_code_humaneval, test_code_mbpp) append to a right solution to make it wrong."""

# The solution's function `{name}`, wrapped so that what it returns is changed (a sequence reversed, a number plus one,
# a bool negated); what the changed value does to the task's own tests is for the tests to say, run as one
# interpreter runs them.
MUTATE = """
_right = {name}
def {name}(*args, **kwargs):
    value = _right(*args, **kwargs)
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + 1
    if isinstance(value, (list, str, tuple)):
        return value[::-1]
    return value
"""
