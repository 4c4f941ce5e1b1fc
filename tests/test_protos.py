import subprocess
import sys


def test_generated_code_is_fresh() -> None:
    proc = subprocess.run([sys.executable, "-m", "specsplit.protogen", "--check"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
