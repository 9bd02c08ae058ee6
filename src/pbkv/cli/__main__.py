from pbkv.cli import app

app()
