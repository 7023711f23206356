"""Safety rails. Bad input refused before any weights load, a broken run stopped, what a killed
run left repaired, recipes read and checked."""
